// A data-parallel MLX trainer in C++ that reports through the mlx-ddp-harness rank protocol
// (docs/rank-protocol.md). Every rank trains a small next-token model (an embedding and an
// output projection) on the rows the harness gives it, with MLX's C++ autodiff and a gradient
// all-summed across the distributed group: the global loss is the sum of the ranks' token
// losses over the global supervised token count, and so is its gradient.
//
//   --width N        the embedding width (default 32)
//   --mean-of-means  a planted bug: average the ranks' per-rank mean losses and gradients
//                    instead of weighting them by tokens (wrong when rows are ragged)
//   --leak-mb N      a planted bug: keep N MB of MLX buffers alive from every step (a leak)
//   --extra-all-sum-on-rank0 STEP
//                    a planted bug: rank 0 issues one extra all_sum (of a 1-element array) at
//                    step STEP, which no other rank matches: the ranks hang, or fail
//
// With MLX_DDP_HARNESS_COLLECTIVES set, it keeps a collective ledger there: one line per
// mx::distributed call, flushed before the call is issued, which the harness compares across
// the ranks when a run fails or hangs (docs/rank-protocol.md).
//
// Build: examples/cpp_worker/build.sh (g++ against the headers and libmlx of the mlx wheel).

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "mlx/mlx.h"

namespace mx = mlx::core;

namespace {

struct Row {
  std::vector<int> ids;
  std::vector<int> mask;  // 1: a training target
};

std::string env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) {
    throw std::runtime_error(std::string("environment variable ") + name + " is not set");
  }
  return v;
}

std::vector<int> numbers(const std::string& text) {
  std::vector<int> out;
  std::istringstream in(text);
  int v;
  while (in >> v) out.push_back(v);
  return out;
}

// rows.tsv: one row per line, "step<TAB>token ids<TAB>target mask", ids and mask space-separated.
std::vector<std::vector<Row>> read_rows(const std::string& path, int steps) {
  std::vector<std::vector<Row>> by_step(steps);
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::istringstream fields(line);
    std::string step, ids, mask;
    std::getline(fields, step, '\t');
    std::getline(fields, ids, '\t');
    std::getline(fields, mask, '\t');
    int s = std::stoi(step);
    if (s < 1 || s > steps) throw std::runtime_error("rows file names step " + step);
    by_step[s - 1].push_back(Row{numbers(ids), numbers(mask)});
  }
  return by_step;
}

// The rows' inputs, next-token targets and target weights, padded to the longest row.
struct Batch {
  mx::array inputs = mx::array(0);
  mx::array targets = mx::array(0);
  mx::array weights = mx::array(0);
  int tokens = 0;
};

Batch collate(const std::vector<Row>& rows) {
  int width = 1;
  for (const auto& r : rows) width = std::max(width, static_cast<int>(r.ids.size()) - 1);
  int n = static_cast<int>(rows.size());
  std::vector<int> in(n * width, 0), tg(n * width, 0);
  std::vector<float> w(n * width, 0.0f);
  int tokens = 0;
  for (int i = 0; i < n; ++i) {
    const auto& r = rows[i];
    for (int t = 0; t + 1 < static_cast<int>(r.ids.size()); ++t) {
      in[i * width + t] = r.ids[t];
      tg[i * width + t] = r.ids[t + 1];
      if (r.mask[t + 1]) {
        w[i * width + t] = 1.0f;
        ++tokens;
      }
    }
  }
  mx::Shape shape{n, width};
  return Batch{mx::array(in.begin(), shape, mx::int32), mx::array(tg.begin(), shape, mx::int32),
               mx::array(w.begin(), shape, mx::float32), tokens};
}

// The summed token loss of a batch (not its mean): ranks add theirs.
std::vector<mx::array> loss_sum(const std::vector<mx::array>& p, const Batch& b) {
  auto h = mx::take(p[0], b.inputs, 0);                       // [rows, width, dim]
  auto logits = mx::matmul(h, p[1]);                           // [rows, width, vocab]
  auto lse = mx::logsumexp(logits, -1, false);
  auto picked = mx::squeeze(mx::take_along_axis(logits, mx::expand_dims(b.targets, -1), -1), -1);
  return {mx::sum((lse - picked) * b.weights)};
}

// A digest of the parameters (FNV-1a over their bytes): equal on two ranks exactly when they are.
std::string digest(const std::vector<mx::array>& params) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& p : params) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(p.data<float>());
    for (size_t i = 0; i < p.nbytes(); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

void event(std::ofstream& out, const std::string& body) {
  out << "{\"protocol\": 1, " << body << "}\n";
  out.flush();
}

// The collective ledger (MLX_DDP_HARNESS_COLLECTIVES; none when it is unset): each collective is
// recorded, its line flushed, before it is issued, so a rank stuck in one has recorded it.
class Ledger {
 public:
  Ledger() {
    const char* path = std::getenv("MLX_DDP_HARNESS_COLLECTIVES");
    if (path != nullptr && *path != '\0') out_.open(path, std::ios::app);
  }

  int step = 0;  // the optimizer step in progress

  // One line: {"protocol": 1, "seq", "op", "shape", "dtype", "group", "step", "site"}.
  void record(const char* op, const mx::array& x, const mx::distributed::Group& group, int line, const char* fn) {
    if (!out_.is_open()) return;
    std::ostringstream shape, dtype;
    for (size_t i = 0; i < x.shape().size(); ++i) shape << (i ? "," : "") << x.shape()[i];
    dtype << x.dtype();
    out_ << "{\"protocol\": 1, \"seq\": " << seq_++ << ", \"op\": \"" << op << "\", \"shape\": [" << shape.str()
         << "], \"dtype\": \"" << dtype.str() << "\", \"group\": " << group.size() << ", \"step\": " << step
         << ", \"site\": \"worker.cpp:" << line << " in " << fn << "\"}\n";
    out_.flush();
  }

  // mx::distributed::all_sum, recorded first (line and fn: the caller's __LINE__ and __func__).
  mx::array all_sum(const mx::array& x, const mx::distributed::Group& group, int line, const char* fn) {
    record("all_sum", x, group, line, fn);
    return mx::distributed::all_sum(x, group);
  }

 private:
  std::ofstream out_;
  long seq_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  int dim = 32;
  bool mean_of_means = false;
  int leak_mb = 0;
  int extra_all_sum_step = 0;  // --extra-all-sum-on-rank0: the step of rank 0's extra all_sum (0: none)
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--width" && i + 1 < argc) {
      dim = std::atoi(argv[++i]);
    } else if (a == "--leak-mb" && i + 1 < argc) {
      leak_mb = std::atoi(argv[++i]);
    } else if (a == "--extra-all-sum-on-rank0" && i + 1 < argc) {
      extra_all_sum_step = std::atoi(argv[++i]);
    } else if (a == "--mean-of-means") {
      mean_of_means = true;
    } else {
      std::cerr << "worker: unknown argument " << a << "\n";
      return 2;
    }
  }
  const std::string out_dir = env("MLX_DDP_HARNESS_OUT");
  std::ofstream events(out_dir + "/events.jsonl", std::ios::app);
  try {
    if (env("MLX_DDP_HARNESS_PROTOCOL") != "1") throw std::runtime_error("this worker speaks protocol 1");
    const int steps = std::stoi(env("MLX_DDP_HARNESS_STEPS"));
    const int vocab = std::stoi(env("MLX_DDP_HARNESS_VOCAB_SIZE"));
    const int split = std::stoi(env("MLX_DDP_HARNESS_SPLIT_ROWS"));
    const float lr = std::stof(env("MLX_DDP_HARNESS_LEARNING_RATE"));
    const uint64_t seed = std::stoull(env("MLX_DDP_HARNESS_SEED"));
    if (env("MLX_DDP_HARNESS_OPTIMIZER") != "sgd") throw std::runtime_error("this worker trains with sgd only");
    auto rows = read_rows(env("MLX_DDP_HARNESS_ROWS"), steps);
    const char* device = std::getenv("MLX_DDP_HARNESS_DEVICE");  // "cpu" or "gpu": [train] device, as planned
    if (device != nullptr && std::string(device) == "cpu") {
      mx::set_default_device(mx::Device::cpu);
    } else if (device != nullptr && std::string(device) == "gpu") {
      mx::set_default_device(mx::Device::gpu);
    }

    auto group = mx::distributed::init();
    const int world = group.size();
    auto keys = mx::random::split(mx::random::key(seed));  // the same weights on every rank
    const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
    std::vector<mx::array> params{mx::random::normal({vocab, dim}, mx::float32, 0.0f, 1.0f, keys.first),
                                  mx::random::normal({dim, vocab}, mx::float32, 0.0f, scale, keys.second)};
    mx::eval(params);
    if (group.rank() == 0) {  // what training starts from, to measure how far it moved
      mx::save_safetensors(out_dir + "/start.safetensors", {{"embed.weight", params[0]}, {"out.weight", params[1]}});
    }
    event(events, "\"kind\": \"start\", \"rank\": " + std::to_string(group.rank()) + ", \"world_size\": " +
                      std::to_string(world) + ", \"digest\": \"" + digest(params) + "\", \"dtype\": \"float32\"");

    std::vector<mx::array> leaked;
    Ledger ledger;
    for (int step = 1; step <= steps; ++step) {
      ledger.step = step;
      // In one process judged against N ranks (split > 1), the rows go in N chunks as N ranks'
      // shares would: the same sums, in the order of N ranks' rounding.
      std::vector<std::vector<Row>> chunks(std::max(split, 1));
      for (size_t i = 0; i < rows[step - 1].size(); ++i) chunks[i % chunks.size()].push_back(rows[step - 1][i]);
      mx::array loss = mx::array(0.0f);
      std::vector<mx::array> grads{mx::zeros_like(params[0]), mx::zeros_like(params[1])};
      int tokens_local = 0;
      for (const auto& chunk : chunks) {
        if (chunk.empty()) continue;
        Batch b = collate(chunk);
        auto fn = [&b](const std::vector<mx::array>& p) { return loss_sum(p, b); };
        auto [value, g] = mx::value_and_grad(fn, std::vector<int>{0, 1})(params);
        loss = loss + value[0];
        grads[0] = grads[0] + g[0];
        grads[1] = grads[1] + g[1];
        tokens_local += b.tokens;
      }
      auto local = mx::array(static_cast<float>(tokens_local));
      auto tokens_global = ledger.all_sum(local, group, __LINE__, __func__);
      if (group.rank() == 0 && step == extra_all_sum_step) {  // the planted bug: a collective no other rank issues
        mx::eval(ledger.all_sum(mx::ones({1}), group, __LINE__, __func__));
      }
      mx::array global_loss = mx::array(0.0f);
      if (mean_of_means) {  // the planted bug: every rank's mean weighs the same
        auto n = mx::maximum(local, mx::array(1.0f));
        global_loss = ledger.all_sum(loss / n, group, __LINE__, __func__) / world;
        for (auto& g : grads) g = ledger.all_sum(g / n, group, __LINE__, __func__) / world;
      } else {
        global_loss = ledger.all_sum(loss, group, __LINE__, __func__) / tokens_global;
        for (auto& g : grads) g = ledger.all_sum(g, group, __LINE__, __func__) / tokens_global;
      }
      for (size_t i = 0; i < params.size(); ++i) params[i] = params[i] - lr * grads[i];
      mx::eval(params);
      mx::eval(global_loss, tokens_global);
      if (leak_mb > 0) {
        leaked.push_back(mx::full({leak_mb * 1024 * 256}, static_cast<float>(step)));
        mx::eval(leaked.back());
      }
      std::ostringstream body;
      body.precision(9);
      body << "\"kind\": \"step\", \"step\": " << step << ", \"loss\": " << global_loss.item<float>()
           << ", \"tokens_global\": " << static_cast<long>(tokens_global.item<float>())
           << ", \"tokens_local\": " << tokens_local << ", \"lr\": " << lr
           << ", \"mlx_peak_bytes\": " << mx::get_peak_memory();
      event(events, body.str());
    }
    mx::save_safetensors(out_dir + "/params.safetensors", {{"embed.weight", params[0]}, {"out.weight", params[1]}});
    std::ofstream result(out_dir + "/result.json");
    result << "{\"protocol\": 1, \"status\": \"ok\", \"steps\": " << steps << "}\n";
  } catch (const std::exception& e) {
    std::cerr << "worker: " << e.what() << "\n";
    std::ofstream result(out_dir + "/result.json");
    std::string msg = e.what();
    for (auto& c : msg) if (c == '"' || c == '\\') c = '\'';
    result << "{\"protocol\": 1, \"status\": \"error\", \"error\": \"" << msg << "\"}\n";
    return 1;
  }
  return 0;
}
