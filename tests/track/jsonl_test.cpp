// JsonlWriter: lines parse back with the right keys, order and values; special floats stay valid
// JSON; appends, creates parents, flushes per line; errors name the path or the key. Also the path
// helpers of d9d/track/detail/file.hpp that the writers use (join, parent, create_directories).
#include <cmath>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>
#include <sys/stat.h>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <d9d/track/jsonl.hpp>
#include <d9d/util/files.hpp>

#include "tests/track/track_test_util.hpp"

namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::ordered_json;

std::vector<std::string> keys_of(const Json& object) {
  std::vector<std::string> keys;
  for (const auto& [key, value] : object.items()) {
    keys.push_back(key);
  }
  return keys;
}

TEST(Track_Jsonl, LinesParseBackInGivenKeyOrder) {
  const auto path = track_test::scratch_dir("jsonl_order") + "/metrics.jsonl";
  d9d::track::JsonlWriter metrics(path);
  metrics.write(3, {{"loss", 2.1}, {"lr", 0.001}}, 1767225600.25);
  metrics.write(4, {{"loss", 1.0 / 3.0}, {"lr", 3e-4}, {"tok/s", 12345.5}}, 1767225601.5);

  const std::vector<std::string> lines = track_test::read_lines(path);
  ASSERT_EQ(lines.size(), 2U);
  EXPECT_EQ(lines[0], R"({"step":3,"wall_time":1767225600.25,"loss":2.1,"lr":0.001})");
  const Json second = Json::parse(lines[1]);
  EXPECT_THAT(keys_of(second), ElementsAre("step", "wall_time", "loss", "lr", "tok/s"));
  EXPECT_EQ(second["step"].get<std::int64_t>(), 4);
  EXPECT_EQ(second["wall_time"].get<double>(), 1767225601.5);
  EXPECT_EQ(second["loss"].get<double>(), 1.0 / 3.0);  // read back bit for bit
  EXPECT_EQ(second["lr"].get<double>(), 3e-4);
  EXPECT_EQ(second["tok/s"].get<double>(), 12345.5);
}

TEST(Track_Jsonl, NonFiniteValuesWrittenAsNull) {
  const auto path = track_test::scratch_dir("jsonl_special") + "/metrics.jsonl";
  d9d::track::JsonlWriter metrics(path);
  metrics.write(1,
                {{"nan", std::nan("")},
                 {"inf", std::numeric_limits<double>::infinity()},
                 {"-inf", -std::numeric_limits<double>::infinity()},
                 {"tiny", 5e-324}},
                10.0);
  const std::vector<std::string> lines = track_test::read_lines(path);
  ASSERT_EQ(lines.size(), 1U);
  EXPECT_EQ(lines[0],
            R"({"step":1,"wall_time":10.0,"nan":null,"inf":null,"-inf":null,"tiny":5e-324})");
  EXPECT_TRUE(Json::accept(lines[0]));
  const Json line = Json::parse(lines[0]);
  EXPECT_TRUE(line["nan"].is_null());
  EXPECT_EQ(line["tiny"].get<double>(), 5e-324);
}

TEST(Track_Jsonl, DefaultWallTimeIsNow) {
  const auto path = track_test::scratch_dir("jsonl_wall_time") + "/metrics.jsonl";
  const double before = d9d::track::detail::unix_time_now();
  d9d::track::JsonlWriter(path).write(0, {});
  const double after = d9d::track::detail::unix_time_now();
  const Json line = Json::parse(track_test::read_lines(path).at(0));
  EXPECT_GE(line["wall_time"].get<double>(), before);
  EXPECT_LE(line["wall_time"].get<double>(), after);
}

TEST(Track_Jsonl, CreatesParentsFlushesPerLineAndAppends) {
  const auto path = track_test::scratch_dir("jsonl_append") + "/a/b/metrics.jsonl";
  {
    d9d::track::JsonlWriter metrics(path);
    metrics.write(1, {{"loss", 2.0}}, 1.0);
    EXPECT_EQ(track_test::read_lines(path).size(), 1U);  // on disk while the writer lives
  }
  d9d::track::JsonlWriter resumed(path);
  resumed.write(2, {{"loss", 1.5}}, 2.0);
  const std::vector<std::string> lines = track_test::read_lines(path);
  ASSERT_EQ(lines.size(), 2U);
  EXPECT_EQ(Json::parse(lines[0])["step"], 1);
  EXPECT_EQ(Json::parse(lines[1])["step"], 2);
}

TEST(Track_Jsonl, ReservedOrDuplicateKeysRejected) {
  const auto path = track_test::scratch_dir("jsonl_keys") + "/metrics.jsonl";
  d9d::track::JsonlWriter metrics(path);
  for (const char* key : {"step", "wall_time"}) {
    try {
      metrics.write(1, {{"loss", 1.0}, {key, 2.0}});
      FAIL() << "expected std::invalid_argument for " << key;
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(std::string("key \"") + key + "\""));
    }
  }
  EXPECT_THROW(metrics.write(1, {{"loss", 1.0}, {"loss", 2.0}}), std::invalid_argument);
  EXPECT_TRUE(track_test::read_lines(path).empty());  // nothing half-written
}

TEST(Track_Jsonl, UnwritablePathThrowsNamingPath) {
  const auto blocker = track_test::scratch_dir("jsonl_unwritable") + "/not_a_dir";
  { std::ofstream(blocker) << "x"; }
  const auto path = blocker + "/metrics.jsonl";
  try {
    d9d::track::JsonlWriter metrics(path);
    FAIL() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(),
                HasSubstr("d9d::track::JsonlWriter: cannot create directory '" + blocker + "'"));
  }
  // A directory where the file should be: the open fails, naming the file.
  const auto dir_in_the_way = track_test::scratch_dir("jsonl_is_dir");
  try {
    d9d::track::JsonlWriter metrics(dir_in_the_way);
    FAIL() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot open '" + dir_in_the_way + "'"));
    EXPECT_THAT(e.what(), HasSubstr("Is a directory"));
  }
}

TEST(Track_File, JoinAndParent) {
  using d9d::files::join;
  using d9d::files::parent;
  EXPECT_EQ(join("a/b", "c"), "a/b/c");
  EXPECT_EQ(join("a/b/", "c"), "a/b/c");
  EXPECT_EQ(join("", "c"), "c");
  EXPECT_EQ(join("/", "c"), "/c");
  EXPECT_EQ(parent("a/b/c.jsonl"), "a/b");
  EXPECT_EQ(parent("a//b"), "a");
  EXPECT_EQ(parent("/c"), "/");
  EXPECT_EQ(parent("c.jsonl"), "");  // nothing to create: the current directory
  EXPECT_EQ(parent("a/b/"), "a/b");
}

TEST(Track_File, CreateDirectoriesMakesParentsAndAcceptsExisting) {
  const std::string root = track_test::scratch_dir("file_create");
  const std::string dir = root + "/x//y/z/";
  d9d::files::create_directories(dir, "who");
  d9d::files::create_directories(dir, "who");  // exists: fine
  d9d::files::create_directories("", "who");   // nothing to do
  struct stat info {};
  ASSERT_EQ(::stat((root + "/x/y/z").c_str(), &info), 0);
  EXPECT_TRUE(S_ISDIR(info.st_mode));
}

TEST(Track_File, CreateDirectoriesOverAFileThrowsNamingPathAndReason) {
  const std::string file = track_test::scratch_dir("file_blocked") + "/plain";
  { std::ofstream(file) << "x"; }
  try {
    d9d::files::create_directories(file, "who");
    FAIL() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "who: cannot create directory '" + file +
                                         "': it exists and is not a directory. Fix: pass a path "
                                         "on a writable file system");
  }
  try {
    d9d::files::create_directories(file + "/below/deeper", "who");
    FAIL() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("who: cannot create directory '" + file +
                                    "/below/deeper': Not a directory"));
  }
}

}  // namespace
