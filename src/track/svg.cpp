// d9d/track/svg.cpp — the SVG writer and line charts (d9d/track/svg.hpp).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unistd.h>
#include <utility>
#include <vector>

#include <d9d/track/detail/file.hpp>
#include <d9d/track/svg.hpp>
#include <d9d/util/files.hpp>

namespace d9d::track {
namespace {

// Up to 6 significant digits, no trailing zeros ("12.5", "0.0003", "1e+06").
std::string number(double value) {
  std::array<char, 32> buffer{};
  std::snprintf(buffer.data(), buffer.size(), "%.6g",  // NOLINT(cppcoreguidelines-pro-type-vararg)
                value);
  return {buffer.data()};
}

// A tick label: 3 significant digits.
std::string tick_label(double value) {
  std::array<char, 32> buffer{};
  std::snprintf(buffer.data(), buffer.size(), "%.3g",  // NOLINT(cppcoreguidelines-pro-type-vararg)
                value);
  return {buffer.data()};
}

std::string with_attributes(std::string element, std::string_view attributes) {
  if (!attributes.empty()) {
    element += ' ';
    element += attributes;
  }
  return element;
}

// A step of 1, 2 or 5 times a power of ten giving about `count` intervals over `span`.
double nice_step(double span, int count) {
  const double raw = span / count;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  const double fraction = raw / power;
  const double nice = fraction <= 1.0 ? 1.0 : fraction <= 2.0 ? 2.0 : fraction <= 5.0 ? 5.0 : 10.0;
  return nice * power;
}

struct Range {
  double low = std::numeric_limits<double>::infinity();
  double high = -std::numeric_limits<double>::infinity();
  void add(double value) {
    low = std::min(low, value);
    high = std::max(high, value);
  }
  // An empty or flat range widened so that it has a length.
  void settle() {
    if (!(low <= high)) {
      low = 0.0;
      high = 1.0;
    } else if (low == high) {
      const double pad = low == 0.0 ? 1.0 : std::abs(low) * 0.1;
      low -= pad;
      high += pad;
    }
  }
};

}  // namespace

std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

Svg::Svg(double width, double height, std::string_view attributes) {
  body_ = with_attributes("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + number(width) +
                              "\" height=\"" + number(height) + "\" viewBox=\"0 0 " +
                              number(width) + " " + number(height) + "\"",
                          attributes) +
          ">\n";
}

Svg& Svg::rect(double x, double y, double width, double height, std::string_view fill,
               std::string_view attributes) {
  body_ += with_attributes("<rect x=\"" + number(x) + "\" y=\"" + number(y) + "\" width=\"" +
                               number(width) + "\" height=\"" + number(height) + "\" fill=\"" +
                               xml_escape(fill) + "\"",
                           attributes) +
           "/>\n";
  return *this;
}

Svg& Svg::line(double x1, double y1, double x2, double y2, std::string_view stroke,
               std::string_view attributes) {
  body_ += with_attributes("<line x1=\"" + number(x1) + "\" y1=\"" + number(y1) + "\" x2=\"" +
                               number(x2) + "\" y2=\"" + number(y2) + "\" stroke=\"" +
                               xml_escape(stroke) + "\"",
                           attributes) +
           "/>\n";
  return *this;
}

Svg& Svg::polyline(const std::vector<std::pair<double, double>>& points, std::string_view stroke,
                   std::string_view attributes) {
  std::string list;
  for (const auto& [x, y] : points) {
    if (!list.empty()) {
      list += ' ';
    }
    list += number(x) + "," + number(y);
  }
  body_ += with_attributes("<polyline fill=\"none\" stroke=\"" + xml_escape(stroke) +
                               "\" points=\"" + list + "\"",
                           attributes) +
           "/>\n";
  return *this;
}

Svg& Svg::text(double x, double y, std::string_view content, std::string_view attributes) {
  body_ += with_attributes("<text x=\"" + number(x) + "\" y=\"" + number(y) + "\"", attributes) +
           ">" + xml_escape(content) + "</text>\n";
  return *this;
}

std::string Svg::str() const { return body_ + "</svg>\n"; }

std::string line_chart(const LineChart& chart) {
  constexpr double kLeft = 64;
  constexpr double kRight = 16;
  constexpr double kTop = 32;
  constexpr double kBottom = 44;
  constexpr int kTicks = 5;
  Range xs;
  Range ys;
  std::vector<std::vector<std::pair<double, double>>> points(chart.series.size());
  for (std::size_t s = 0; s < chart.series.size(); ++s) {
    const auto& series = chart.series[s];
    if (!series.x.empty() && series.x.size() != series.y.size()) {
      throw std::invalid_argument("d9d::track::line_chart: series \"" + series.label + "\" has " +
                                  std::to_string(series.x.size()) + " x values and " +
                                  std::to_string(series.y.size()) + " y values");
    }
    for (std::size_t i = 0; i < series.y.size(); ++i) {
      const double x = series.x.empty() ? static_cast<double>(i) : series.x[i];
      const double y = series.y[i];
      if (std::isfinite(x) && std::isfinite(y)) {
        points[s].emplace_back(x, y);
        xs.add(x);
        ys.add(y);
      }
    }
  }
  xs.settle();
  ys.settle();
  const double plot_w = chart.width - kLeft - kRight;
  const double plot_h = chart.height - kTop - kBottom;
  const auto px = [&](double x) { return kLeft + (x - xs.low) / (xs.high - xs.low) * plot_w; };
  const auto py = [&](double y) { return kTop + (ys.high - y) / (ys.high - ys.low) * plot_h; };

  Svg svg(chart.width, chart.height, R"(font-family="sans-serif" font-size="11")");
  svg.rect(0, 0, chart.width, chart.height, "white");
  svg.text(kLeft, 20, chart.title, R"(font-size="14")");
  // Grid and ticks.
  const double x_step = nice_step(xs.high - xs.low, kTicks);
  for (double x = std::ceil(xs.low / x_step) * x_step; x <= xs.high + x_step * 1e-9; x += x_step) {
    svg.line(px(x), kTop, px(x), kTop + plot_h, "#e6e6e6");
    svg.text(px(x), kTop + plot_h + 14, tick_label(x), R"(text-anchor="middle")");
  }
  const double y_step = nice_step(ys.high - ys.low, kTicks);
  for (double y = std::ceil(ys.low / y_step) * y_step; y <= ys.high + y_step * 1e-9; y += y_step) {
    svg.line(kLeft, py(y), kLeft + plot_w, py(y), "#e6e6e6");
    svg.text(kLeft - 6, py(y) + 4, tick_label(y), R"(text-anchor="end")");
  }
  svg.rect(kLeft, kTop, plot_w, plot_h, "none", R"(stroke="#999999")");
  svg.text(kLeft + plot_w / 2, chart.height - 8, chart.x_label, R"(text-anchor="middle")");
  svg.text(14, kTop + plot_h / 2, chart.y_label,
           "text-anchor=\"middle\" transform=\"rotate(-90 14 " + number(kTop + plot_h / 2) + ")\"");
  // Curves, then the legend.
  double legend_x = kLeft + plot_w;
  for (std::size_t s = chart.series.size(); s-- > 0;) {
    std::vector<std::pair<double, double>> placed;
    placed.reserve(points[s].size());
    for (const auto& [x, y] : points[s]) {
      placed.emplace_back(px(x), py(y));
    }
    const auto& series = chart.series[s];
    svg.polyline(placed, series.colour, R"(stroke-width="1.5")");
    if (!series.label.empty()) {
      legend_x -= 8.0 + 7.0 * static_cast<double>(series.label.size());
      svg.rect(legend_x - 14, 12, 10, 10, series.colour);
      svg.text(legend_x, 21, series.label);
      legend_x -= 20;
    }
  }
  return svg.str();
}

void write_text_file(const std::string& path, std::string_view text) {
  constexpr std::string_view kWho = "d9d::track::write_text_file";
  const std::string parent = files::parent(path);
  if (!parent.empty()) {
    files::create_directories(parent, kWho);
  }
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  {
    const detail::FilePtr file = detail::open_file(temporary, "wb", kWho);
    detail::write_all(file.get(), text, temporary, kWho);
    detail::flush(file.get(), temporary, kWho);
  }
  files::rename(temporary, path);
}

}  // namespace d9d::track
