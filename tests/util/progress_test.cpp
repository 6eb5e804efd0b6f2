// ProgressBar with a fake clock: exact lines, rate and ETA, throttling, the '\r' redraw of
// interactive mode, width limits; and the formatting helpers.
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/util/progress.hpp>

namespace {

using ::testing::EndsWith;

using d9d::util::ProgressBar;
using d9d::util::ProgressMode;

/// A FILE* writing into memory (open_memstream), for capturing a ProgressBar's output.
class MemoryStream {
 public:
  MemoryStream() : file_(open_memstream(&buffer_, &size_)) {}
  ~MemoryStream() {
    std::fclose(file_);
    std::free(buffer_);  // open_memstream allocates with malloc
  }
  MemoryStream(const MemoryStream&) = delete;
  MemoryStream& operator=(const MemoryStream&) = delete;
  MemoryStream(MemoryStream&&) = delete;
  MemoryStream& operator=(MemoryStream&&) = delete;

  [[nodiscard]] std::FILE* file() const { return file_; }
  [[nodiscard]] std::string str() const {
    std::fflush(file_);
    return {buffer_, size_};
  }

 private:
  char* buffer_ = nullptr;
  std::size_t size_ = 0;
  std::FILE* file_;
};

/// Each test's captured output and a fake clock (seconds, moved by the test).
class ProgressTest : public ::testing::Test {
 protected:
  MemoryStream out;
  double now = 0;
  std::function<double()> clock = [this] { return now; };
};
class Util_Progress_plain : public ProgressTest {};
class Util_Progress_interactive : public ProgressTest {};

TEST_F(Util_Progress_plain, ShowsRateAndEta) {
  ProgressBar bar(300, "train", {.out = out.file(), .mode = ProgressMode::plain, .clock = clock});
  now = 33.2;
  bar.update(150, {{"loss", "2.134"}, {"lr", "3.0e-04"}});
  EXPECT_EQ(out.str(),
            "train [==========>         ] 150/300  loss 2.134  lr 3.0e-04  4.52 it/s  ETA 00:33\n");
}

TEST_F(Util_Progress_plain, PrintsFirstUpdateThenThrottledThenLastStep) {
  ProgressBar bar(10, "train",
                  {.out = out.file(),
                   .mode = ProgressMode::plain,
                   .print_interval_s = 5,
                   .bar_width = 10,
                   .clock = clock});
  for (int step = 1; step <= 10; ++step) {
    now = step;  // one step a second
    bar.update(step, {{"loss", "2.000"}});
  }
  bar.finish();  // the last step was printed already
  EXPECT_EQ(out.str(),
            "train [=>        ]  1/10  loss 2.000  1.00 it/s  ETA 00:09\n"
            "train [======>   ]  6/10  loss 2.000  1.00 it/s  ETA 00:04\n"
            "train [==========] 10/10  loss 2.000  1.00 it/s  took 00:10\n");
}

TEST_F(Util_Progress_plain, FinishPrintsAnUnshownFinalState) {
  ProgressBar bar(10, "train",
                  {.out = out.file(),
                   .mode = ProgressMode::plain,
                   .print_interval_s = 100,
                   .bar_width = 10,
                   .clock = clock});
  now = 1;
  bar.update(1);
  now = 4;
  bar.update(4);  // throttled
  now = 5;
  bar.finish();   // stopped early: the final state, with the time taken
  bar.update(5);  // ignored after finish
  EXPECT_EQ(out.str(),
            "train [=>        ]  1/10  1.00 it/s  ETA 00:09\n"
            "train [====>     ]  4/10  1.25 s/it  took 00:05\n");
}

TEST_F(Util_Progress_plain, SlowStepsShowSecondsPerStep) {
  ProgressBar bar(5, "eval", {.out = out.file(), .mode = ProgressMode::plain, .clock = clock});
  now = 3.2;
  bar.update(1);
  EXPECT_EQ(out.str(), "eval [====>               ] 1/5  3.20 s/it  ETA 00:13\n");
}

TEST_F(Util_Progress_plain, ResumedRunCountsOnlyNewSteps) {
  ProgressBar bar(
      200, "train",
      {.out = out.file(), .mode = ProgressMode::plain, .initial_step = 100, .clock = clock});
  now = 5;
  bar.update(110);
  EXPECT_EQ(out.str(), "train [===========>        ] 110/200  2.00 it/s  ETA 00:45\n");
}

TEST_F(Util_Progress_plain, UnknownTotalHasNoBarAndShowsElapsed) {
  ProgressBar bar(0, "stream", {.out = out.file(), .mode = ProgressMode::plain, .clock = clock});
  now = 2;
  bar.update(5, {{"tok/s", "12.3k"}});
  EXPECT_EQ(out.str(), "stream 5  tok/s 12.3k  2.50 it/s  elapsed 00:02\n");
}

TEST_F(Util_Progress_plain, AutomaticModeIsPlainWhenNotATerminal) {
  const ProgressBar bar(10, "train", {.out = out.file()});
  EXPECT_FALSE(bar.interactive());
}

TEST_F(Util_Progress_interactive, RedrawsOneLineWithCarriageReturn) {
  ProgressBar bar(
      4, "train",
      {.out = out.file(), .mode = ProgressMode::interactive, .bar_width = 10, .clock = clock});
  ASSERT_TRUE(bar.interactive());
  now = 1;
  bar.update(1, {{"loss", "10.00"}});
  now = 1.05;
  bar.update(2, {{"loss", "9.75"}});  // within redraw_interval_s (0.1 s) of the last draw: skipped
  now = 2;
  bar.update(3, {{"loss", "9.5"}});  // 2 characters shorter: padded to wipe the old line
  EXPECT_EQ(out.str(),
            "\rtrain [==>       ] 1/4  loss 10.00  1.00 it/s  ETA 00:03"
            "\rtrain [=======>  ] 3/4  loss 9.5  1.50 it/s  ETA 00:01  ");
  now = 4;
  bar.finish();
  EXPECT_THAT(out.str(), EndsWith("\rtrain [=======>  ] 3/4  loss 9.5  1.33 s/it  took 00:04\n"));
  EXPECT_EQ(bar.last_line(), "train [=======>  ] 3/4  loss 9.5  1.33 s/it  took 00:04");
}

TEST_F(Util_Progress_interactive, LastStepAlwaysRedraws) {
  ProgressBar bar(
      2, "t",
      {.out = out.file(), .mode = ProgressMode::interactive, .bar_width = 4, .clock = clock});
  now = 1;
  bar.update(1);
  now = 1.01;
  bar.update(2);
  EXPECT_EQ(out.str(),
            "\rt [==> ] 1/2  1.00 it/s  ETA 00:01"
            "\rt [====] 2/2  1.98 it/s  took 00:01");
}

TEST_F(Util_Progress_interactive, WidthLimitDropsFieldsFromTheRight) {
  ProgressBar bar(
      100, "train",
      {.out = out.file(), .mode = ProgressMode::interactive, .max_width = 72, .clock = clock});
  now = 10;
  bar.update(50, {{"loss", "2.134"}, {"lr", "3.0e-04"}, {"tok/s", "12.3k"}, {"mem", "71.2G"}});
  EXPECT_EQ(bar.last_line(),
            "train [==========>         ]  50/100  loss 2.134  5.00 it/s  ETA 00:10");
  EXPECT_LE(bar.last_line().size(), 72U) << bar.last_line();
}

TEST_F(Util_Progress_interactive, HardTruncatesWhenNoFieldIsLeftToDrop) {
  ProgressBar bar(
      100, "a-very-long-label-for-a-narrow-line",
      {.out = out.file(), .mode = ProgressMode::interactive, .max_width = 40, .clock = clock});
  now = 1;
  bar.update(1, {{"loss", "2.0"}});
  EXPECT_EQ(bar.last_line(), "a-very-long-label-for-a-narrow-line [>  ");
}

TEST_F(Util_Progress_interactive, WriteClearsTheBarPrintsAndRedraws) {
  ProgressBar bar(
      4, "t",
      {.out = out.file(), .mode = ProgressMode::interactive, .bar_width = 4, .clock = clock});
  now = 1;
  bar.update(1);
  const std::string line = "t [=>  ] 1/4  1.00 it/s  ETA 00:03";
  bar.write("checkpoint saved");
  EXPECT_EQ(out.str(),
            "\r" + line + "\r" + std::string(line.size(), ' ') + "\rcheckpoint saved\n\r" + line);
}

TEST_F(Util_Progress_interactive, DestructorEndsAnOpenLine) {
  {
    ProgressBar bar(
        4, "t",
        {.out = out.file(), .mode = ProgressMode::interactive, .bar_width = 4, .clock = clock});
    now = 1;
    bar.update(1);
  }
  EXPECT_EQ(out.str(), "\rt [=>  ] 1/4  1.00 it/s  ETA 00:03\n");
}

TEST_F(Util_Progress_plain, WriteIsAPlainLine) {
  ProgressBar bar(4, "t", {.out = out.file(), .mode = ProgressMode::plain});
  bar.write("checkpoint saved");
  EXPECT_EQ(out.str(), "checkpoint saved\n");
}

TEST(Util_Progress, InvalidArgumentsRejected) {
  MemoryStream out;
  EXPECT_THROW(ProgressBar(-1, "t", {.out = out.file()}), std::invalid_argument);
  EXPECT_THROW(ProgressBar(1, "t", {.out = out.file(), .bar_width = 0}), std::invalid_argument);
  EXPECT_THROW(ProgressBar(1, "t", {.out = nullptr}), std::invalid_argument);
}

TEST(Util_Progress, FormatSi) {
  const std::vector<std::pair<double, std::string>> cases = {
      {0, "0"},
      {1, "1.00"},
      {4.518, "4.52"},
      {9.995, "10.0"},
      {45.26, "45.3"},
      {999, "999"},
      {999.4, "999"},
      {999.5, "1.00k"},
      {12345, "12.3k"},
      {2.5e6, "2.50M"},
      {1.5e9, "1.50G"},
      {-12345, "-12.3k"},
      {0.5, "0.500"},
      {0.0123, "0.0123"},
      {std::numeric_limits<double>::quiet_NaN(), "nan"},
      {std::numeric_limits<double>::infinity(), "inf"},
      {-std::numeric_limits<double>::infinity(), "-inf"},
  };
  for (const auto& [value, text] : cases) {
    EXPECT_EQ(d9d::util::format_si(value), text) << value;
  }
}

TEST(Util_Progress, FormatDuration) {
  const std::vector<std::pair<double, std::string>> cases = {
      {0, "00:00"},
      {39, "00:39"},
      {59.6, "01:00"},
      {3599, "59:59"},
      {3600, "1:00:00"},
      {3725, "1:02:05"},
      {100000, "27:46:40"},
      {-1, "--:--"},
      {std::numeric_limits<double>::quiet_NaN(), "--:--"},
      {std::numeric_limits<double>::infinity(), "--:--"},
  };
  for (const auto& [value, text] : cases) {
    EXPECT_EQ(d9d::util::format_duration(value), text) << value;
  }
}

}  // namespace
