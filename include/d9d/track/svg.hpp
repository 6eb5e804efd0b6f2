// d9d/track/svg.hpp — the pictures of a run: a small SVG writer and line charts of per-step
// curves (the trainer's loss and learning-rate charts, the pipeline's timelines).
//
//   d9d::track::LineChart chart{.title = "loss", .x_label = "step", .series = {{.y = losses}}};
//   d9d::track::write_text_file("runs/exp1/loss.svg", d9d::track::line_chart(chart));
//   d9d::track::Svg svg(640, 360);  svg.rect(0, 0, 10, 10, "#4C78A8");  svg.str();
//
// No LibTorch.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace d9d::track {

/// An SVG document built element by element; numbers are written with up to 6 significant digits
/// and text is escaped (&, <, >, "). `attributes` are extra raw attributes of an element.
class Svg {
 public:
  Svg(double width, double height, std::string_view attributes = {});
  Svg& rect(double x, double y, double width, double height, std::string_view fill,
            std::string_view attributes = {});
  Svg& line(double x1, double y1, double x2, double y2, std::string_view stroke,
            std::string_view attributes = {});
  /// One <polyline> through the points, stroked, not filled.
  Svg& polyline(const std::vector<std::pair<double, double>>& points, std::string_view stroke,
                std::string_view attributes = {});
  Svg& text(double x, double y, std::string_view content, std::string_view attributes = {});
  /// The document, closed.
  [[nodiscard]] std::string str() const;

 private:
  std::string body_;
};

/// `text` with &, <, >, " and ' replaced by their XML entities.
[[nodiscard]] std::string xml_escape(std::string_view text);

/// One curve of a LineChart: y per point; x per point, or 0, 1, 2, ... when empty.
struct ChartSeries {
  std::string label = {};
  std::vector<double> x = {};
  std::vector<double> y = {};
  std::string colour = "#4C78A8";
};

/// A line chart: axes with ticks, one polyline per series (points whose x or y is not finite are
/// left out), a legend when a series has a label.
struct LineChart {
  std::string title = {};
  std::string x_label = {};
  std::string y_label = {};
  std::vector<ChartSeries> series = {};
  double width = 640;
  double height = 360;
};

/// The chart as an SVG document. std::invalid_argument when a series' x and y differ in length.
[[nodiscard]] std::string line_chart(const LineChart& chart);

/// Writes `text` to `path` (replacing it, through a temporary file and a rename; parent
/// directories created); std::runtime_error naming the path and the reason.
void write_text_file(const std::string& path, std::string_view text);

}  // namespace d9d::track
