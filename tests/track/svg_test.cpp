// The SVG writer and line charts (d9d/track/svg.hpp, src/track/svg.cpp): exact
// elements, escaping, one polyline per series with one point per finite value, files replaced.
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/track/svg.hpp>

#include "tests/track/track_test_util.hpp"

namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) {
    ++n;
  }
  return n;
}

// The points attribute of the only polyline of `svg`, split at spaces.
std::vector<std::string> polyline_points(const std::string& svg) {
  EXPECT_EQ(count(svg, "<polyline"), 1U);
  const auto at = svg.find("points=\"", svg.find("<polyline"));
  const auto end = svg.find('"', at + 8);
  const std::string list = svg.substr(at + 8, end - at - 8);
  std::vector<std::string> points;
  for (std::size_t from = 0; from <= list.size();) {
    const auto space = list.find(' ', from);
    const auto stop = space == std::string::npos ? list.size() : space;
    if (stop > from) {
      points.push_back(list.substr(from, stop - from));
    }
    from = stop + 1;
  }
  return points;
}

TEST(Track_Svg, WritesElementsAndEscapesText) {
  d9d::track::Svg svg(100, 50, R"(font-size="11")");
  svg.rect(0, 0, 100, 50, "white")
      .line(1, 2, 3.5, 4, "#999999")
      .polyline({{0, 0}, {10, 2.25}, {20, 1e-7}}, "red", R"(stroke-width="2")")
      .text(5, 6, "a < b & \"c\"");
  EXPECT_EQ(svg.str(),
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"100\" height=\"50\" "
            "viewBox=\"0 0 100 50\" font-size=\"11\">\n"
            "<rect x=\"0\" y=\"0\" width=\"100\" height=\"50\" fill=\"white\"/>\n"
            "<line x1=\"1\" y1=\"2\" x2=\"3.5\" y2=\"4\" stroke=\"#999999\"/>\n"
            "<polyline fill=\"none\" stroke=\"red\" points=\"0,0 10,2.25 20,1e-07\" "
            "stroke-width=\"2\"/>\n"
            "<text x=\"5\" y=\"6\">a &lt; b &amp; &quot;c&quot;</text>\n"
            "</svg>\n");
  EXPECT_EQ(d9d::track::xml_escape("it's <x>"), "it&apos;s &lt;x&gt;");
}

TEST(Track_Svg, LineChartHasOnePointPerFiniteValue) {
  std::vector<double> loss(30);
  for (std::size_t i = 0; i < loss.size(); ++i) {
    loss[i] = 5.0 * std::exp(-0.1 * static_cast<double>(i));
  }
  const std::string svg = d9d::track::line_chart(
      {.title = "loss <train>", .x_label = "step", .y_label = "loss", .series = {{.y = loss}}});
  EXPECT_THAT(svg, StartsWith("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"640\""));
  EXPECT_THAT(svg, HasSubstr(">loss &lt;train&gt;</text>"));
  EXPECT_EQ(count(svg, "</svg>"), 1U);
  const auto points = polyline_points(svg);
  ASSERT_EQ(points.size(), loss.size());
  // x grows with the step, y falls with the loss (SVG's y axis points down).
  const auto coordinate = [](const std::string& point, int which) {
    const auto comma = point.find(',');
    return std::stod(which == 0 ? point.substr(0, comma) : point.substr(comma + 1));
  };
  for (std::size_t i = 1; i < points.size(); ++i) {
    EXPECT_GT(coordinate(points[i], 0), coordinate(points[i - 1], 0)) << i;
    EXPECT_GT(coordinate(points[i], 1), coordinate(points[i - 1], 1)) << i;
  }
  // The curve spans the plot: first point at the left edge, top; last at the right edge, bottom.
  EXPECT_DOUBLE_EQ(coordinate(points.front(), 0), 64.0);
  EXPECT_DOUBLE_EQ(coordinate(points.back(), 0), 640.0 - 16.0);
  EXPECT_DOUBLE_EQ(coordinate(points.front(), 1), 32.0);
  EXPECT_DOUBLE_EQ(coordinate(points.back(), 1), 360.0 - 44.0);
}

TEST(Track_Svg, LineChartLeavesOutNonFinitePointsAndChecksSizes) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::string svg = d9d::track::line_chart(
      {.series = {{.label = "loss", .x = {10, 11, 12, 13}, .y = {1.0, nan, inf, 0.5}}}});
  EXPECT_EQ(polyline_points(svg).size(), 2U);
  EXPECT_THAT(svg, HasSubstr(">loss</text>"));  // the legend
  // A flat or empty series still draws (the range is widened).
  EXPECT_EQ(polyline_points(d9d::track::line_chart({.series = {{.y = {2.0, 2.0, 2.0}}}})).size(),
            3U);
  EXPECT_EQ(polyline_points(d9d::track::line_chart({.series = {{.y = {}}}})).size(), 0U);
  try {
    (void)d9d::track::line_chart({.series = {{.label = "lr", .x = {1, 2}, .y = {1}}}});
    FAIL() << "no error";
  } catch (const std::invalid_argument& error) {
    EXPECT_THAT(error.what(), HasSubstr("series \"lr\" has 2 x values and 1 y values"));
  }
}

TEST(Track_Svg, WriteTextFileReplacesTheFile) {
  const std::string dir = track_test::scratch_dir("svg_write");
  const std::string path = dir + "/pictures/loss.svg";
  d9d::track::write_text_file(path, "first, longer text");
  d9d::track::write_text_file(path, "second");
  EXPECT_EQ(track_test::read_file(path), "second");
  EXPECT_THROW(d9d::track::write_text_file(dir + "/pictures/loss.svg/x", "x"), std::runtime_error);
}

}  // namespace
