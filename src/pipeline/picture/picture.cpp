// d9d/pipeline/picture.cpp — pipeline timelines as SVG (d9d/pipeline/picture.hpp).
#include <algorithm>
#include <array>
#include <cstdio>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <d9d/pipeline/picture.hpp>
#include <d9d/track/svg.hpp>

namespace d9d::pipeline {
namespace {

const char* colour(Op op) {
  switch (op) {
    case Op::forward:
      return "#4C78A8";
    case Op::backward:
      return "#B279A2";
    case Op::backward_input:
      return "#54A24B";
    case Op::backward_weight:
      return "#F58518";
    default:
      return "#999999";
  }
}

std::string format(const char* pattern, double a, double b) {
  std::array<char, 96> buffer{};
  std::snprintf(buffer.data(), buffer.size(), pattern,
                a,  // NOLINT(cppcoreguidelines-pro-type-vararg)
                b);
  return {buffer.data()};
}

// Times in ms: a panel heading with the makespan and the bubble.
std::string heading(const std::string& title, const Timeline& timeline) {
  return title + format(":  %.2f ms, bubble %.1f%%", 1e3 * timeline.makespan,
                        100 * timeline.bubble_fraction());
}

}  // namespace

std::string timeline_svg(const TimelinePicture& picture) {
  constexpr double kRow = 34;
  constexpr double kLeft = 70;
  constexpr double kTop = 40;
  constexpr double kPanelHead = 22;
  constexpr double kPanelGap = 14;
  constexpr double kCharWidth = 7;  // of an 11-pixel monospace label
  double longest = 0;
  double rows_height = 0;
  for (const auto& panel : picture.panels) {
    longest = std::max(longest, panel.timeline.makespan);
    rows_height += (panel.title.empty() ? 0 : kPanelHead + kPanelGap) +
                   static_cast<double>(panel.timeline.ranks.size()) * kRow;
  }
  const double unit = picture.unit_width > 0 ? picture.unit_width
                      : longest > 0          ? picture.width / longest
                                             : 1.0;
  const double width = kLeft + longest * unit + 20;
  const double height = kTop + rows_height + 30;
  track::Svg out(width, height, R"(font-family="monospace" font-size="11")");
  out.rect(0, 0, width, height, "white");
  out.text(10, 22, picture.title, R"(font-size="14")");
  double y = kTop;
  for (std::size_t p = 0; p < picture.panels.size(); ++p) {
    const auto& panel = picture.panels[p];
    const auto& timeline = panel.timeline;
    if (!panel.title.empty()) {
      out.text(kLeft, y + 14, panel.title, R"(font-size="12")");
      y += kPanelHead;
    }
    for (std::size_t r = 0; r < timeline.ranks.size(); ++r) {
      out.text(10, y + 20, "rank " + std::to_string(r));
      out.rect(kLeft, y, timeline.makespan * unit, kRow - 6, "#f2f2f2");
      for (const auto& slot : timeline.ranks[r]) {
        const double x = kLeft + slot.start * unit;
        const double w = (slot.end - slot.start) * unit;
        const auto label = to_string(slot.action);
        out.rect(x, y, w, kRow - 6, colour(slot.action.op),
                 R"(stroke="white" class="action" data-panel=")" + std::to_string(p) +
                     R"(" data-rank=")" + std::to_string(r) + R"(" data-action=")" + label +
                     R"(")");
        if (w >= kCharWidth * static_cast<double>(label.size()) + 4) {
          out.text(x + 3, y + 18, label, R"(fill="white")");
        }
      }
      y += kRow;
    }
    if (!panel.title.empty()) {
      y += kPanelGap;
    }
  }
  const double legend = y + 16;
  double x = kLeft;
  for (const auto& [label, op] :
       std::map<std::string, Op>{{"F forward", Op::forward},
                                 {"B backward", Op::backward},
                                 {"I input grad", Op::backward_input},
                                 {"W weight grad", Op::backward_weight}}) {
    out.rect(x, legend - 10, 12, 12, colour(op));
    out.text(x + 16, legend, label);
    x += 130;
  }
  return out.str();
}

Costs measured_costs(const Timeline& timeline) {
  std::array<double, 3> sum{};  // F, I, W
  std::array<double, 3> count{};
  for (const auto& rank : timeline.ranks) {
    for (const auto& slot : rank) {
      const double d = slot.end - slot.start;
      switch (slot.action.op) {
        case Op::forward:
          sum[0] += d;
          count[0] += 1;
          break;
        case Op::backward:
          sum[1] += d / 2;
          count[1] += 1;
          sum[2] += d / 2;
          count[2] += 1;
          break;
        case Op::backward_input:
          sum[1] += d;
          count[1] += 1;
          break;
        case Op::backward_weight:
          sum[2] += d;
          count[2] += 1;
          break;
        default:
          break;
      }
    }
  }
  double known = 0;
  double known_count = 0;
  std::array<double, 3> mean{};
  for (std::size_t i = 0; i < 3; ++i) {
    if (count[i] > 0) {
      mean[i] = sum[i] / count[i];
      known += mean[i];
      known_count += 1;
    }
  }
  const double fallback = known_count > 0 ? known / known_count : 1.0;
  for (std::size_t i = 0; i < 3; ++i) {
    if (count[i] == 0) {
      mean[i] = fallback;
    }
  }
  return {.forward = mean[0], .backward_input = mean[1], .backward_weight = mean[2]};
}

std::string planned_and_measured_svg(const Program& program,
                                     const std::vector<TimelinePanel>& measured,
                                     std::string_view title) {
  const auto costs = measured.empty() ? Costs{} : measured_costs(measured.front().timeline);
  TimelinePicture picture{.title = std::string(title)};
  const auto plan = simulate(program, costs);
  picture.panels.push_back(
      {.title = heading("planned (the program at the measured mean costs)", plan),
       .timeline = plan});
  for (const auto& panel : measured) {
    picture.panels.push_back(
        {.title = heading(panel.title, panel.timeline), .timeline = panel.timeline});
  }
  return timeline_svg(picture);
}

}  // namespace d9d::pipeline
