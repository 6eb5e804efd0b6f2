// d9d/state/safetensors_sharded.cpp — Hugging Face-style sharded safetensors checkpoints.
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <set>
#include <stdexcept>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>

#include <d9d/state/safetensors_sharded.hpp>
#include <d9d/util/files.hpp>
#include <d9d/util/json.hpp>
#include <d9d/util/quote.hpp>

namespace d9d::state {

using util::Json;

namespace {

// True for "model-<digits>-of-<digits>.safetensors" (at least 5 digits each): a shard name.
bool is_shard_name(std::string_view name) {
  constexpr std::string_view kPrefix = "model-";
  constexpr std::string_view kMiddle = "-of-";
  constexpr std::string_view kSuffix = ".safetensors";
  if (!name.starts_with(kPrefix) || !name.ends_with(kSuffix)) {
    return false;
  }
  name = name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  const std::size_t middle = name.find(kMiddle);
  if (middle == std::string_view::npos) {
    return false;
  }
  const auto digits = [](std::string_view part) {
    return part.size() >= 5 && part.find_first_not_of("0123456789") == std::string_view::npos;
  };
  return digits(name.substr(0, middle)) && digits(name.substr(middle + kMiddle.size()));
}

// A file's whole content (at most `limit` bytes), or std::runtime_error "<who>: <path>: ...".
std::string read_text(const std::string& path, const std::string& who, uint64_t limit) {
  const auto fail = [&](const std::string& what) {
    throw std::runtime_error(who + ": " + path + ": " + what);
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    fail("cannot open (" + std::string(std::strerror(errno)) + ")");
  }
  std::string text;
  struct stat info {};
  std::string problem;
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    problem = "not a regular file";
  } else if (static_cast<uint64_t>(info.st_size) > limit) {
    problem = std::to_string(info.st_size) + " bytes, over the limit of " + std::to_string(limit);
  } else {
    text.resize(static_cast<std::size_t>(info.st_size));
    std::size_t done = 0;
    while (done < text.size()) {
      const ssize_t got = ::read(fd, text.data() + done, text.size() - done);
      if (got < 0 && errno == EINTR) {
        continue;
      }
      if (got <= 0) {
        problem = got == 0 ? std::string("shorter than its size; changed while read")
                           : "read failed (" + std::string(std::strerror(errno)) + ")";
        break;
      }
      done += static_cast<std::size_t>(got);
    }
  }
  ::close(fd);
  if (!problem.empty()) {
    fail(problem);
  }
  return text;
}

// The checks save_safetensors makes on each shard, made once over all tensors before any file is
// touched (a name given twice may land in two shards).
void check_inputs(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata,
                  uint64_t max_shard_bytes, const std::string& who) {
  if (max_shard_bytes == 0) {
    throw std::invalid_argument(who + "max_shard_bytes is 0; pass the largest shard in bytes");
  }
  std::set<std::string_view> names;
  for (const auto& [name, tensor] : tensors) {
    if (name == "__metadata__") {
      throw std::invalid_argument(who + "\"__metadata__\" is reserved and cannot name a tensor");
    }
    if (!names.insert(name).second) {
      throw std::invalid_argument(who + "tensor name " + util::quoted(name) + " is given twice");
    }
    if (util::first_invalid_utf8(name) != std::string_view::npos) {
      throw std::invalid_argument(who + "tensor name " + util::quoted(name) +
                                  " is not valid UTF-8");
    }
    if (!tensor.defined()) {
      throw std::invalid_argument(who + "tensor " + util::quoted(name) + " is undefined");
    }
    if (tensor.layout() != at::kStrided) {
      throw std::invalid_argument(who + "tensor " + util::quoted(name) + " is not strided");
    }
    try {
      (void)safetensors_dtype_name(tensor.scalar_type());
    } catch (const std::invalid_argument& error) {
      throw std::invalid_argument(who + "tensor " + util::quoted(name) + ": " + error.what());
    }
  }
  for (const auto& [key, value] : metadata) {
    if (util::first_invalid_utf8(key) != std::string_view::npos ||
        util::first_invalid_utf8(value) != std::string_view::npos) {
      throw std::invalid_argument(who + "metadata " + util::quoted(key) + " is not valid UTF-8");
    }
  }
}

}  // namespace

std::vector<std::string> SafetensorsIndex::files() const {
  std::set<std::string> unique;
  for (const auto& [name, file] : weight_map) {
    unique.insert(file);
  }
  return {unique.begin(), unique.end()};
}

std::string SafetensorsIndex::path_of(std::string_view name) const {
  const auto found = weight_map.find(name);
  if (found == weight_map.end()) {
    throw std::out_of_range(
        "d9d::state::SafetensorsIndex: " + files::join(dir, kSafetensorsIndexName) +
        ": no tensor " + util::quoted(name) + " in the weight_map");
  }
  return files::join(dir, found->second);
}

std::string safetensors_shard_name(std::size_t shard, std::size_t shards) {
  std::array<char, 64> name{};
  std::snprintf(name.data(), name.size(), "model-%05zu-of-%05zu.safetensors", shard, shards);
  return name.data();
}

SafetensorsIndex save_safetensors_sharded(const std::string& dir, const NamedTensors& tensors,
                                          uint64_t max_shard_bytes,
                                          const std::map<std::string, std::string>& metadata) {
  const std::string who = "d9d::state::save_safetensors_sharded: " + dir + ": ";
  check_inputs(tensors, metadata, max_shard_bytes, who);

  // Greedy, in the order given; a tensor over the limit alone.
  std::vector<NamedTensors> shards(1);
  uint64_t current = 0;
  SafetensorsIndex index{.dir = dir, .total_size = 0, .weight_map = {}};
  for (const auto& named : tensors) {
    const auto bytes = static_cast<uint64_t>(named.second.nbytes());
    index.total_size += bytes;
    if (!shards.back().empty() && (bytes > max_shard_bytes || current + bytes > max_shard_bytes)) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(named);
    current += bytes;
  }

  files::create_directories(dir, "d9d::state::save_safetensors_sharded");
  const std::string index_path = files::join(dir, kSafetensorsIndexName);
  if (::unlink(index_path.c_str()) != 0 && errno != ENOENT) {
    throw std::runtime_error(who + "cannot remove the old index " + index_path + " (" +
                             std::strerror(errno) + ")");
  }
  std::set<std::string> written;
  for (std::size_t k = 0; k < shards.size(); ++k) {
    const std::string name = safetensors_shard_name(k + 1, shards.size());
    save_safetensors(files::join(dir, name), shards[k], metadata);
    written.insert(name);
    for (const auto& named : shards[k]) {
      index.weight_map.emplace(named.first, name);
    }
  }

  Json weight_map = Json::object();
  for (const auto& [name, file] : index.weight_map) {  // sorted by name, as Hugging Face writes
    weight_map[name] = file;
  }
  const Json json = {{"metadata", {{"total_size", index.total_size}}},
                     {"weight_map", std::move(weight_map)}};
  const std::string text = json.dump(2) + "\n";
  files::AtomicFile file(index_path, "d9d::state::save_safetensors_sharded");
  file.write(text.data(), text.size());
  file.commit();

  // Shards of an earlier save with another count would otherwise stay behind.
  if (DIR* listing = ::opendir(dir.c_str())) {
    std::vector<std::string> stale;
    while (const dirent* entry = ::readdir(listing)) {
      const std::string name = entry->d_name;
      if (is_shard_name(name) && written.count(name) == 0) {
        stale.push_back(name);
      }
    }
    ::closedir(listing);
    for (const auto& name : stale) {
      ::unlink(files::join(dir, name).c_str());
    }
  }
  files::sync_directory(dir);
  return index;
}

SafetensorsIndex load_safetensors_index(const std::string& dir) {
  const std::string who = "d9d::state::load_safetensors_index";
  const std::string path = files::join(dir, kSafetensorsIndexName);
  const auto fail = [&](const std::string& what) {
    throw std::runtime_error(who + ": " + path + ": " + what);
  };
  const std::string text = read_text(path, who, kSafetensorsMaxHeaderBytes);
  Json json;
  try {
    json = util::parse_strict_json(text, 32);
  } catch (const util::JsonError& error) {
    fail((error.top_key().empty() ? "" : util::quoted(error.top_key()) + ": ") + error.what());
  }
  if (!json.is_object()) {
    fail("not a JSON object");
  }
  SafetensorsIndex index{.dir = dir, .total_size = 0, .weight_map = {}};
  if (json.contains("metadata")) {
    const Json& metadata = json.at("metadata");
    if (!metadata.is_object()) {
      fail("\"metadata\" is not an object");
    }
    if (metadata.contains("total_size")) {
      const Json& total = metadata.at("total_size");
      // Some writers store it as a float; it is informational, so any whole number >= 0 is fine.
      if (total.is_number_unsigned()) {
        index.total_size = total.get<uint64_t>();
      } else if (total.is_number_float() && total.get<double>() >= 0 &&
                 total.get<double>() < 1.8e19 &&
                 total.get<double>() ==
                     static_cast<double>(static_cast<uint64_t>(total.get<double>()))) {
        index.total_size = static_cast<uint64_t>(total.get<double>());
      } else {
        fail("\"metadata\".\"total_size\" " + util::short_dump(total) +
             " is not a whole number >= 0");
      }
    }
  }
  if (!json.contains("weight_map") || !json.at("weight_map").is_object()) {
    fail("no \"weight_map\" object; not a safetensors index");
  }
  for (const auto& [name, file] : json.at("weight_map").items()) {
    if (!file.is_string()) {
      fail("\"weight_map\": tensor " + util::quoted(name) + " maps to " + util::short_dump(file) +
           ", not a file name");
    }
    const auto& file_name = file.get_ref<const std::string&>();
    if (file_name.empty() || file_name == "." || file_name == ".." ||
        file_name.find('/') != std::string::npos || file_name.find('\0') != std::string::npos) {
      fail("\"weight_map\": tensor " + util::quoted(name) + " maps to " + util::quoted(file_name) +
           ", not a plain file name inside the checkpoint directory");
    }
    index.weight_map.emplace(name, file_name);
  }
  return index;
}

std::vector<SafetensorsFile> open_safetensors_shards(const SafetensorsIndex& index,
                                                     std::string_view who) {
  const std::string index_path = files::join(index.dir, kSafetensorsIndexName);
  std::vector<SafetensorsFile> shards;
  for (const auto& file : index.files()) {
    SafetensorsFile shard = open_safetensors_as(files::join(index.dir, file), who);
    for (const auto& entry : shard.entries()) {
      const auto found = index.weight_map.find(entry.name);
      if (found == index.weight_map.end() || found->second != file) {
        throw std::runtime_error(
            std::string(who) + ": " + shard.path() + ": tensor " + util::quoted(entry.name) +
            " is in this shard, " +
            (found == index.weight_map.end()
                 ? "but " + index_path + " does not list it"
                 : "but " + index_path + " maps it to " + util::quoted(found->second)));
      }
    }
    for (const auto& [name, mapped] : index.weight_map) {
      if (mapped == file && !shard.contains(name)) {
        throw std::runtime_error(std::string(who) + ": " + index_path + ": maps tensor " +
                                 util::quoted(name) + " to " + util::quoted(file) +
                                 ", which does not hold it");
      }
    }
    shards.push_back(std::move(shard));
  }
  return shards;
}

NamedTensors load_safetensors_sharded(const std::string& dir) {
  const SafetensorsIndex index = load_safetensors_index(dir);
  NamedTensors tensors;
  tensors.reserve(index.weight_map.size());
  for (const auto& shard : open_safetensors_shards(index, "d9d::state::load_safetensors_sharded")) {
    for (const auto& entry : shard.entries()) {
      tensors.emplace_back(entry.name, shard.tensor(entry.name));
    }
  }
  return tensors;
}

NamedTensors load_safetensors_sharded(const std::string& dir,
                                      const std::vector<std::string>& names) {
  const std::string who = "d9d::state::load_safetensors_sharded";
  const SafetensorsIndex index = load_safetensors_index(dir);
  std::map<std::string, SafetensorsFile> shards;
  for (const auto& name : names) {
    const std::string path = index.path_of(name);  // std::out_of_range when not listed
    if (shards.count(path) == 0) {
      shards.emplace(path, open_safetensors_as(path, who));
    }
  }
  NamedTensors tensors;
  tensors.reserve(names.size());
  for (const auto& name : names) {
    const SafetensorsFile& shard = shards.at(index.path_of(name));
    if (!shard.contains(name)) {
      throw std::runtime_error(who + ": " + files::join(dir, kSafetensorsIndexName) +
                               ": maps tensor " + util::quoted(name) + " to " + shard.path() +
                               ", which does not hold it");
    }
    tensors.emplace_back(name, shard.tensor(name));
  }
  return tensors;
}

}  // namespace d9d::state
