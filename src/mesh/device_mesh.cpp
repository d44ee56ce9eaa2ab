// DeviceMesh rank arithmetic and cached sub-communicators.
#include "dtrain/mesh/device_mesh.hpp"

#include <algorithm>
#include <set>

#include "dtrain/core/error.hpp"

namespace dtrain {

using detail::str_cat;

const std::vector<std::string>& mesh_axis_order() {
  static const std::vector<std::string> order = {"pp", "dp", "dp_replicate", "dp_shard",
                                                 "cp", "ep", "tp"};
  return order;
}

namespace {
std::string describe_axes(const MeshAxes& axes) {
  std::string s;
  for (std::size_t i = 0; i < axes.size(); ++i) {
    s += str_cat(i ? " x " : "", axes[i].first, "=", axes[i].second);
  }
  return s.empty() ? std::string("(no axes)") : s;
}

std::string allowed_order() {
  std::string s;
  for (const auto& n : mesh_axis_order()) s += (s.empty() ? "" : ", ") + n;
  return s;
}
}  // namespace

MeshLayout::MeshLayout(MeshAxes axes, int world_size)
    : axes_(std::move(axes)), world_size_(world_size) {
  const std::string desc = describe_axes(axes_);
  DTRAIN_CHECK_ARG(!axes_.empty(), "device mesh needs at least one axis; allowed: ",
                   allowed_order());
  const auto& order = mesh_axis_order();
  int last = -1;
  std::set<std::string> seen;
  for (const auto& [name, n] : axes_) {
    auto it = std::find(order.begin(), order.end(), name);
    DTRAIN_CHECK_ARG(it != order.end(), "device mesh ", desc, ": axis '", name,
                     "' is not known; allowed, in this order: ", allowed_order());
    DTRAIN_CHECK_ARG(seen.insert(name).second, "device mesh ", desc, ": axis '", name,
                     "' appears twice");
    const int pos = static_cast<int>(it - order.begin());
    DTRAIN_CHECK_ARG(pos > last, "device mesh ", desc, ": axis '", name,
                     "' is out of order; axes must follow the order ", allowed_order(),
                     " (tp innermost)");
    last = pos;
    DTRAIN_CHECK_ARG(n >= 1, "device mesh ", desc, ": axis ", name, "=", n,
                     " must be at least 1");
  }
  DTRAIN_CHECK_ARG(!(seen.count("dp") && (seen.count("dp_replicate") || seen.count("dp_shard"))),
                   "device mesh ", desc, ": use either 'dp' or 'dp_replicate'/'dp_shard', not both");
  long long product = 1;
  for (const auto& a : axes_) product *= a.second;
  DTRAIN_CHECK_ARG(product == world_size_, "device mesh ", desc, " = ", product,
                   " ranks does not match the world size ", world_size_,
                   "; the product of the axis sizes must equal the world size");
  strides_.assign(axes_.size(), 1);
  for (int i = static_cast<int>(axes_.size()) - 2; i >= 0; --i) {
    strides_[i] = strides_[i + 1] * axes_[i + 1].second;
  }
}

int MeshLayout::index_of(const std::string& axis) const {
  for (std::size_t i = 0; i < axes_.size(); ++i) {
    if (axes_[i].first == axis) return static_cast<int>(i);
  }
  return -1;
}

int MeshLayout::size(const std::string& axis) const {
  const int i = index_of(axis);
  return i < 0 ? 1 : axes_[i].second;
}

std::vector<int> MeshLayout::coords(int rank) const {
  DTRAIN_CHECK_ARG(rank >= 0 && rank < world_size_, "device mesh ", describe(), ": rank ",
                   rank, " is out of range; allowed: 0..", world_size_ - 1);
  std::vector<int> c(axes_.size());
  for (std::size_t i = 0; i < axes_.size(); ++i) c[i] = (rank / strides_[i]) % axes_[i].second;
  return c;
}

int MeshLayout::coord(int rank, const std::string& axis) const {
  const int i = index_of(axis);
  return i < 0 ? 0 : coords(rank)[i];
}

int MeshLayout::rank_of(const std::vector<int>& coords) const {
  DTRAIN_CHECK_ARG(coords.size() == axes_.size(), "device mesh ", describe(), ": ",
                   coords.size(), " coordinates given; it has ", axes_.size(), " axes");
  int r = 0;
  for (std::size_t i = 0; i < axes_.size(); ++i) {
    DTRAIN_CHECK_ARG(coords[i] >= 0 && coords[i] < axes_[i].second, "device mesh ",
                     describe(), ": coordinate ", coords[i], " on axis ", axes_[i].first,
                     " is out of range; allowed: 0..", axes_[i].second - 1);
    r += coords[i] * strides_[i];
  }
  return r;
}

std::vector<int> MeshLayout::checked_indices(const std::vector<std::string>& axes) const {
  std::vector<int> idx;
  for (const auto& a : axes) {
    const int i = index_of(a);
    DTRAIN_CHECK_ARG(i >= 0 || std::find(mesh_axis_order().begin(), mesh_axis_order().end(),
                                         a) != mesh_axis_order().end(),
                     "device mesh ", describe(), ": axis '", a, "' is not known; allowed: ",
                     allowed_order());
    if (i >= 0) idx.push_back(i);  // an absent known axis has size 1: contributes nothing
  }
  std::sort(idx.begin(), idx.end());
  DTRAIN_CHECK_ARG(std::adjacent_find(idx.begin(), idx.end()) == idx.end(), "device mesh ",
                   describe(), ": an axis is requested twice");
  return idx;
}

std::vector<int> MeshLayout::group(int rank, const std::vector<std::string>& axes) const {
  const auto idx = checked_indices(axes);
  const auto base = coords(rank);
  int n = 1;
  for (int i : idx) n *= axes_[i].second;
  std::vector<int> out;
  out.reserve(n);
  for (int k = 0; k < n; ++k) {  // k enumerates the group in row-major order of `idx`
    auto c = base;
    int rest = k;
    for (int j = static_cast<int>(idx.size()) - 1; j >= 0; --j) {
      c[idx[j]] = rest % axes_[idx[j]].second;
      rest /= axes_[idx[j]].second;
    }
    out.push_back(rank_of(c));
  }
  return out;
}

std::pair<int, int> MeshLayout::color_key(int rank, const std::vector<std::string>& axes) const {
  const auto idx = checked_indices(axes);
  auto c = coords(rank);
  int key = 0;
  for (int i : idx) {
    key = key * axes_[i].second + c[i];
    c[i] = 0;  // the color is the rank with the group's axes zeroed
  }
  return {rank_of(c), key};
}

std::string MeshLayout::describe() const { return describe_axes(axes_); }

// ---------------------------------------------------------------------------------------

namespace {
const CommPtr& non_null(const CommPtr& world) {
  DTRAIN_CHECK_ARG(world != nullptr, "device mesh needs a world communicator, got null");
  return world;
}
}  // namespace

DeviceMesh::DeviceMesh(CommPtr world, MeshAxes axes)
    : world_(non_null(world)), layout_(std::move(axes), world_->size()) {}

int DeviceMesh::coord(const std::string& axis) const {
  return layout_.coord(world_->rank(), axis);
}

CommPtr DeviceMesh::comm(const std::string& axis) {
  return comm(std::vector<std::string>{axis});
}

CommPtr DeviceMesh::comm(const std::vector<std::string>& axes) {
  const auto [color, key] = layout_.color_key(world_->rank(), axes);
  // Cache key and name: the requested axes in mesh order, joined by '+'.
  std::string name;
  for (const auto& a : mesh_axis_order()) {
    if (std::find(axes.begin(), axes.end(), a) != axes.end()) {
      name += (name.empty() ? "" : "+") + a;
    }
  }
  auto it = cache_.find(name);
  if (it != cache_.end()) return it->second;
  CommPtr c;
  if (static_cast<int>(layout_.group(world_->rank(), axes).size()) == world_->size()) {
    c = world_;
  } else {
    c = world_->split(color, key, name);
  }
  cache_.emplace(name, c);
  return c;
}

}  // namespace dtrain
