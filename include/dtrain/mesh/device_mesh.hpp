// DeviceMesh: the world's ranks laid out on named axes (pp, dp_replicate, dp_shard, cp, ep,
// tp; tp fastest-varying so tensor-parallel ranks are neighbours on a node), and the
// sub-communicator of any axis or set of axes, created once by split and cached.
#pragma once

#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/communicator.hpp"

namespace dtrain {

// Allowed axis names in their fixed order (outermost first). "dp" is the plain
// data-parallel axis; it excludes dp_replicate/dp_shard.
const std::vector<std::string>& mesh_axis_order();

using MeshAxes = std::vector<std::pair<std::string, int>>;

// Pure rank arithmetic of a mesh (row-major, last axis fastest); no communication.
class MeshLayout {
 public:
  // Raises InvalidArgument (printing every factor and the world size) when names are
  // unknown, repeated or out of order, a size is < 1, or the product is not world_size.
  MeshLayout(MeshAxes axes, int world_size);

  const MeshAxes& axes() const { return axes_; }
  int world_size() const { return world_size_; }
  bool has(const std::string& axis) const { return index_of(axis) >= 0; }
  // Size of an axis; 1 for an axis the mesh does not have.
  int size(const std::string& axis) const;
  std::vector<int> coords(int rank) const;
  int coord(int rank, const std::string& axis) const;
  int rank_of(const std::vector<int>& coords) const;
  // World ranks of the group over `axes` that contains `rank`, in group-rank order.
  std::vector<int> group(int rank, const std::vector<std::string>& axes) const;
  // (color, key) that split() needs to form those groups.
  std::pair<int, int> color_key(int rank, const std::vector<std::string>& axes) const;
  // "pp=2 x dp=2 x tp=4"
  std::string describe() const;

 private:
  int index_of(const std::string& axis) const;
  std::vector<int> checked_indices(const std::vector<std::string>& axes) const;

  MeshAxes axes_;
  int world_size_;
  std::vector<int> strides_;
};

// Thread-safety: call from one thread. comm() is collective over the world the first time
// a given set of axes is requested: every rank must ask for the same sets in the same order.
class DeviceMesh {
 public:
  DeviceMesh(CommPtr world, MeshAxes axes);

  const MeshLayout& layout() const { return layout_; }
  const CommPtr& world() const { return world_; }
  int size(const std::string& axis) const { return layout_.size(axis); }
  // This rank's coordinate on an axis (0 for an axis the mesh does not have).
  int coord(const std::string& axis) const;
  // Communicator over one axis or several (any order given; mesh order used). An axis of
  // size 1, or one the mesh does not have, gives a Self communicator.
  CommPtr comm(const std::string& axis);
  CommPtr comm(const std::vector<std::string>& axes);
  // Braced lists ({"dp", "tp"}) land here rather than on std::string's iterator pair.
  CommPtr comm(std::initializer_list<std::string> axes) {
    return comm(std::vector<std::string>(axes));
  }

 private:
  CommPtr world_;
  MeshLayout layout_;
  std::map<std::string, CommPtr> cache_;
};

}  // namespace dtrain
