// tools/pipeline_picture — draws a pipeline schedule as an SVG timeline and prints its bubble.
//
//   pipeline_picture --schedule zb_h1 --pp 4 --microbatches 8 --svg zbh1.svg
//   pipeline_picture --schedule 1f1b --pp 4 --microbatches 8 --costs 1,2,0   # B = 2 F, no split
//   pipeline_picture --schedule dual_pipe_v --pp 4 --microbatches 8 --svg dualpipev.svg
//
// One row per rank; F, B, I and W are coloured, idle time is left blank
// (d9d::pipeline::timeline_svg, which also draws the executor's measured timelines under their
// plan). The timing comes from d9d::pipeline::simulate (each rank runs its program in order; a step
// starts when the rank is free and its inputs exist; communication is free). Prints the bubble
// fraction and each rank's peak number of live activations.
#include <cstdio>
#include <fstream>
#include <string>

#include <CLI/CLI.hpp>

#include <d9d/pipeline/builders.hpp>
#include <d9d/pipeline/picture.hpp>
#include <d9d/pipeline/verify.hpp>

namespace {

namespace pl = d9d::pipeline;

pl::Program build(const std::string& name, int pp, int v, int m) {
  if (name == "gpipe") {
    return pl::gpipe(pp, m);
  }
  if (name == "looped_bfs") {
    return pl::looped_bfs(pp, v, m);
  }
  if (name == "1f1b") {
    return pl::one_f_one_b(pp, m);
  }
  if (name == "interleaved_1f1b") {
    return pl::interleaved_1f1b(pp, v, m);
  }
  if (name == "zb_h1") {
    return pl::zero_bubble_h1(pp, m);
  }
  if (name == "zbv") {
    return pl::zero_bubble_v(pp, m);
  }
  if (name == "dual_pipe_v") {
    return pl::dual_pipe_v(pp, m);
  }
  if (name == "inference") {
    return pl::inference(pp, m, v);
  }
  throw CLI::ValidationError("--schedule", "unknown schedule \"" + name + "\"");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Draw a d9d pipeline schedule and print its bubble fraction"};
  std::string schedule = "1f1b";
  int pp = 4;
  int microbatches = 8;
  int stages_per_rank = 2;
  std::string costs = "1,1,1";
  std::string svg_path;
  app.add_option("--schedule", schedule,
                 "gpipe, looped_bfs, 1f1b, interleaved_1f1b, zb_h1, zbv, dual_pipe_v, inference");
  app.add_option("--pp", pp, "pipeline degree");
  app.add_option("--microbatches", microbatches, "microbatches per step");
  app.add_option("--stages-per-rank", stages_per_rank, "for looped_bfs / interleaved_1f1b");
  app.add_option("--costs", costs, "F,I,W relative costs (a full B costs I + W)");
  app.add_option("--svg", svg_path, "write the timeline here");
  CLI11_PARSE(app, argc, argv);

  pl::Costs c;
  {
    // F,I,W: three numbers separated by commas.
    std::istringstream in(costs);
    char comma1 = 0;
    char comma2 = 0;
    in >> c.forward >> comma1 >> c.backward_input >> comma2 >> c.backward_weight;
    if (!in || comma1 != ',' || comma2 != ',' || !(in >> std::ws).eof()) {
      std::fprintf(stderr, "--costs must be F,I,W (three numbers), got \"%s\"\n", costs.c_str());
      return 2;
    }
  }
  try {
    const auto program = pl::with_communication(build(schedule, pp, stages_per_rank, microbatches));
    const auto verdict = pl::verify(program);
    if (!verdict.ok()) {
      std::fprintf(stderr, "the program is invalid: rank %d at %s\n", verdict.rank,
                   pl::to_string(verdict.action).c_str());
      return 1;
    }
    const auto timeline = pl::simulate(program, c);
    std::printf("%s pp=%d microbatches=%d: bubble %.4f, makespan %.2f, peak activations per rank:",
                schedule.c_str(), pp, microbatches, timeline.bubble_fraction(), timeline.makespan);
    for (const int peak : verdict.peak_activations) {
      std::printf(" %d", peak);
    }
    std::printf("\n");
    if (!svg_path.empty()) {
      char title[160];
      std::snprintf(title, sizeof(title), "%s  pp=%d  microbatches=%d  bubble %.1f%%",  // NOLINT
                    schedule.c_str(), pp, microbatches, 100 * timeline.bubble_fraction());
      // 28 pixels per unit of cost (d9d/pipeline/picture.hpp draws measured timelines the same).
      std::ofstream(svg_path) << pl::timeline_svg(
          {.title = title, .panels = {{.title = "", .timeline = timeline}}, .unit_width = 28});
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return 2;
  }
  return 0;
}
