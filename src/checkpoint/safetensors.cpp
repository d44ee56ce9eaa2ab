// safetensors writer (durable, checksummed) and reader (header validation, ranged reads).
#include "dtrain/checkpoint/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "file_io.hpp"

namespace dtrain::checkpoint {

namespace {

const std::pair<const char*, at::ScalarType> kDtypes[] = {
    {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16}, {"F64", at::kDouble},
    {"I64", at::kLong},  {"I32", at::kInt},   {"I16", at::kShort},     {"I8", at::kChar},
    {"U8", at::kByte},   {"BOOL", at::kBool}};

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw CheckpointError("checkpoint file '" + path + "': " + problem);
}

std::string system_error(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

// Writes all of [data, data + size), hashing it; false with errno set on failure.
bool write_all(int fd, const void* data, std::size_t size, std::uint64_t& hash) {
  const auto* p = static_cast<const char*>(data);
  hash = fnv1a64(p, size, hash);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EIO;
      return false;
    }
    p += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

}  // namespace

std::uint64_t fnv1a64(const void* data, std::size_t size, std::uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t h = seed;
  for (std::size_t i = 0; i < size; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

std::string checksum_text(std::uint64_t hash) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "fnv1a64:%016llx", static_cast<unsigned long long>(hash));
  return buf;
}

std::string dtype_name(at::ScalarType t) {
  for (const auto& [name, type] : kDtypes) {
    if (type == t) return name;
  }
  throw InvalidArgument(detail::str_cat("safetensors: dtype ", c10::toString(t),
                                        " is not supported; allowed: float32, float16, bfloat16, "
                                        "float64, int64, int32, int16, int8, uint8, bool"));
}

at::ScalarType TensorInfo::scalar_type() const {
  for (const auto& [name, type] : kDtypes) {
    if (dtype == name) return type;
  }
  throw CheckpointError("safetensors dtype '" + dtype + "' is not supported");
}

std::int64_t TensorInfo::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::uint64_t write_safetensors(const std::string& path,
                                const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                const std::map<std::string, std::string>& metadata) {
  std::vector<at::Tensor> cpu;
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::int64_t at = 0;
  for (const auto& [name, t] : tensors) {
    DTRAIN_CHECK_ARG(name != "__metadata__" && !name.empty() && !header.contains(name), "safetensors '",
                     path, "': tensor name '", name, "' is empty, reserved or repeated");
    cpu.push_back(t.detach().to(torch::kCPU).contiguous());
    const auto bytes = static_cast<std::int64_t>(cpu.back().nbytes());
    header[name] = {{"dtype", dtype_name(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {at, at + bytes}}};
    at += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  const std::uint64_t length = text.size();
  unsigned char prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<unsigned char>(length >> (8 * i));

  std::vector<io::Buffer> buffers{{prefix, 8}, {text.data(), text.size()}};
  for (const auto& t : cpu) buffers.push_back({t.data_ptr(), t.nbytes()});
  return io::write_file(path, buffers);
}

std::uint64_t io::write_file(const std::string& path, const std::vector<Buffer>& buffers) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(path, system_error("cannot be created"));
  std::uint64_t hash = 0xcbf29ce484222325ULL;
  bool ok = true;
  for (std::size_t i = 0; ok && i < buffers.size(); ++i) ok = write_all(fd, buffers[i].data, buffers[i].size, hash);
  std::string problem = ok ? "" : system_error("write failed");
  if (ok && ::fsync(fd) != 0) ok = false, problem = system_error("fsync failed");
  if (::close(fd) != 0 && ok) ok = false, problem = system_error("close failed");
  if (!ok) {
    ::unlink(path.c_str());  // no partial file left behind
    fail(path, problem);
  }
  return hash;
}

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail(path, system_error("cannot be opened"));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    ::close(fd_);
    fail(path, system_error("cannot be read"));
  }
  size_ = static_cast<std::int64_t>(st.st_size);
  try {
    if (size_ < 8) fail(path, "truncated: " + std::to_string(size_) + " bytes, shorter than the 8-byte header length");
    unsigned char prefix[8];
    read_bytes(prefix, 0, 8);
    std::uint64_t length = 0;
    for (int i = 0; i < 8; ++i) length |= static_cast<std::uint64_t>(prefix[i]) << (8 * i);
    if (length > static_cast<std::uint64_t>(size_ - 8)) {
      fail(path, "truncated or not a safetensors file: the header claims " + std::to_string(length) +
                     " bytes but the file has " + std::to_string(size_));
    }
    std::string text(length, '\0');
    read_bytes(text.data(), 8, static_cast<std::int64_t>(length));
    data_start_ = 8 + static_cast<std::int64_t>(length);
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      fail(path, std::string("malformed header: ") + e.what());
    }
    if (!header.is_object()) fail(path, "malformed header: not a JSON object");
    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") {
        for (const auto& [key, value] : entry.items()) {
          if (!value.is_string()) fail(path, "metadata '" + key + "' is not a string");
          metadata_[key] = value.get<std::string>();
        }
        continue;
      }
      TensorInfo info;
      try {
        info.dtype = entry.at("dtype").get<std::string>();
        info.shape = entry.at("shape").get<std::vector<std::int64_t>>();
        const auto offsets = entry.at("data_offsets").get<std::vector<std::int64_t>>();
        if (offsets.size() != 2) fail(path, "tensor '" + name + "': data_offsets must hold 2 numbers");
        info.begin = offsets[0], info.end = offsets[1];
      } catch (const nlohmann::json::exception& e) {
        fail(path, "tensor '" + name + "': malformed entry: " + e.what());
      }
      const auto type = info.scalar_type();
      const std::int64_t expected = info.numel() * static_cast<std::int64_t>(c10::elementSize(type));
      if (info.begin < 0 || info.end < info.begin || info.end - info.begin != expected) {
        fail(path, "tensor '" + name + "': data_offsets [" + std::to_string(info.begin) + ", " +
                       std::to_string(info.end) + ") do not hold " + std::to_string(expected) +
                       " bytes of its dtype and shape");
      }
      if (data_start_ + info.end > size_) {
        fail(path, "truncated: tensor '" + name + "' ends at byte " + std::to_string(data_start_ + info.end) +
                       " but the file has " + std::to_string(size_));
      }
      tensors_[name] = std::move(info);
    }
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::pair<std::int64_t, std::string>> order;
  for (const auto& [name, info] : tensors_) order.emplace_back(info.begin, name);
  std::sort(order.begin(), order.end());
  std::vector<std::string> out;
  for (auto& item : order) out.push_back(std::move(item.second));
  return out;
}

const TensorInfo& SafetensorsReader::info(const std::string& name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) fail(path_, "holds no tensor '" + name + "'");
  return it->second;
}

void SafetensorsReader::read_bytes(void* into, std::int64_t at, std::int64_t bytes) const {
  auto* p = static_cast<char*>(into);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_, p, static_cast<std::size_t>(bytes), at);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(path_, system_error("read failed"));
    if (n == 0) fail(path_, "truncated: unexpected end of file at byte " + std::to_string(at));
    p += n, at += n, bytes -= n;
  }
}

at::Tensor SafetensorsReader::read(const std::string& name) const {
  const auto& i = info(name);
  return read_range(name, 0, i.numel()).view(i.shape);
}

at::Tensor SafetensorsReader::read_range(const std::string& name, std::int64_t offset,
                                         std::int64_t numel) const {
  const auto& i = info(name);
  if (offset < 0 || numel < 0 || offset + numel > i.numel()) {
    throw InvalidArgument(detail::str_cat("checkpoint file '", path_, "': elements [", offset, ", ",
                                          offset + numel, ") are outside tensor '", name, "' of ",
                                          i.numel(), " elements"));
  }
  auto out = torch::empty({numel}, torch::TensorOptions().dtype(i.scalar_type()));
  const auto es = static_cast<std::int64_t>(out.element_size());
  read_bytes(out.data_ptr(), data_start_ + i.begin + offset * es, numel * es);
  return out;
}

std::uint64_t SafetensorsReader::checksum() const { return file_checksum(path_); }

std::uint64_t file_checksum(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, system_error("cannot be opened"));
  std::vector<char> buf(16 << 20);
  std::uint64_t hash = 0xcbf29ce484222325ULL;
  while (true) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const auto problem = system_error("read failed");
      ::close(fd);
      fail(path, problem);
    }
    if (n == 0) break;
    hash = fnv1a64(buf.data(), static_cast<std::size_t>(n), hash);
  }
  ::close(fd);
  return hash;
}

}  // namespace dtrain::checkpoint
