// d9d/pipeline/picture.hpp — pipeline timelines drawn as SVG: the program as planned (simulate)
// and as it ran (Executor::timeline(), gather_timeline()), one under the other on one time scale.
//
//   executor.record_timeline(true);  executor.run(inputs, loss);
//   const auto measured = d9d::pipeline::gather_timeline(group, executor.timeline());
//   d9d::track::write_text_file("pp.svg", d9d::pipeline::planned_and_measured_svg(program,
//                                             {{.title = "measured", .timeline = measured}}, ""));
//
// One row per rank; F, B, I and W are coloured, idle time is left blank. Each action is one
// <rect class="action" data-panel="p" data-rank="r" data-action="0F1">. No LibTorch: compiled in
// //src/pipeline/picture, which tools/pipeline_picture uses too.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <d9d/pipeline/program.hpp>
#include <d9d/pipeline/verify.hpp>

namespace d9d::pipeline {

/// One timeline of a picture under its heading.
struct TimelinePanel {
  std::string title = {};
  Timeline timeline = {};
};

/// Timelines drawn one under another on one time scale.
struct TimelinePicture {
  std::string title = {};
  std::vector<TimelinePanel> panels = {};
  double unit_width = 0;  ///< pixels per time unit; 0: the longest panel fills `width`
  double width = 1200;    ///< pixels of the longest panel when unit_width is 0
};

/// The picture as an SVG document.
[[nodiscard]] std::string timeline_svg(const TimelinePicture& picture);

/// The mean duration of F, I and W in a timeline (a full B counts half as I and half as W), in
/// the timeline's unit; an op that never ran gets the mean of those that did (1 when none did).
[[nodiscard]] Costs measured_costs(const Timeline& timeline);

/// `program` as planned — simulate() at the first measured timeline's mean costs — above each
/// measured timeline (seconds; drawn and labelled in ms), with each panel's bubble.
[[nodiscard]] std::string planned_and_measured_svg(const Program& program,
                                                   const std::vector<TimelinePanel>& measured,
                                                   std::string_view title);

}  // namespace d9d::pipeline
