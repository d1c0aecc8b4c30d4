// OffloadPipeline on the CPU, over host copy queues: the whole block lifecycle (gradients copied out,
// the CPU update, new weights copied back, the wait before the next forward), held passes released with
// a multiplier or cancelled, a block staged again before its last pass was consumed, and a failed copy
// reported to the waiting thread. Every result is compared bit for bit with a single-threaded AdamW on
// copies of the same data. Runs under ThreadSanitizer in CI as well (the queues' threads, the engine's
// workers and the training thread all touch a pass).
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "host_copy_queue.h"
#include "hytrain/adamw.h"
#include "hytrain/dtype.h"
#include "hytrain/error.h"
#include "hytrain/offload_pipeline.h"

using namespace hytrain;
using hytest::HostCopyQueue;

namespace {

// One bf16 parameter as the pipeline sees it: "device" weight and gradient, host master, m, v and the
// staging buffer (gradient in, new weight out); and the reference state stepped by adamw_step.
struct Param {
  std::vector<uint16_t> weight, grad, staging;
  std::vector<float> master, m, v;
  std::vector<float> ref_master, ref_m, ref_v;
  std::vector<uint16_t> ref_weight;
  int64_t step = 0;

  Param(int64_t n, std::mt19937& rng) : weight(n), grad(n), staging(n, 0xFFFF), master(n), m(n), v(n) {
    std::normal_distribution<float> normal;
    for (int64_t i = 0; i < n; ++i) {
      weight[i] = f32_to_bf16(normal(rng) * 0.02f);
      master[i] = bf16_to_f32(weight[i]);
    }
    ref_master = master, ref_m = m, ref_v = v, ref_weight = weight;
  }

  void new_gradient(std::mt19937& rng) {
    std::normal_distribution<float> normal;
    for (auto& g : grad) g = f32_to_bf16(normal(rng) * 1e-2f);
  }

  AdamWConfig config(double grad_scale) const {
    AdamWConfig c;
    c.step = step;
    c.lr = 1e-3;
    c.weight_decay = 0.01;
    c.grad_scale = grad_scale;
    return c;
  }

  UpdateJob job(double grad_scale) {
    UpdateJob j;
    j.tensor = AdamWTensor{master.data(), m.data(), v.data(), nullptr, staging.data(), DType::bf16,
                           staging.data(), DType::bf16, static_cast<int64_t>(master.size())};
    j.config = config(grad_scale);
    return j;
  }

  void reference_step(double grad_scale) {
    std::vector<uint16_t> g = grad;  // the update writes the new weight over the gradient it read
    AdamWTensor t{ref_master.data(), ref_m.data(), ref_v.data(), nullptr, g.data(), DType::bf16, g.data(),
                  DType::bf16, static_cast<int64_t>(ref_master.size())};
    adamw_step(t, config(grad_scale), 1, SimdPath::scalar);
    ref_weight = g;
  }

  void check_equal_to_reference() const {
    CHECK(master == ref_master);
    CHECK(m == ref_m);
    CHECK(v == ref_v);
    CHECK(weight == ref_weight);
  }
};

struct Block {
  std::vector<Param> params;
  std::vector<HostCopy> d2h() {
    std::vector<HostCopy> out;
    for (Param& p : params) out.push_back({p.staging.data(), p.grad.data(), p.grad.size() * 2});
    return out;
  }
  std::vector<HostCopy> h2d() {
    std::vector<HostCopy> out;
    for (Param& p : params) out.push_back({p.weight.data(), p.staging.data(), p.weight.size() * 2});
    return out;
  }
  std::vector<UpdateJob> jobs(double grad_scale) {
    std::vector<UpdateJob> out;
    for (Param& p : params) {
      ++p.step;
      out.push_back(p.job(grad_scale));
    }
    return out;
  }
};

std::vector<Block> make_blocks(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Block> blocks(n);
  const int64_t sizes[] = {1, 1000, 70'001, 1 << 17};
  for (int b = 0; b < n; ++b) {
    for (int i = 0; i < 2; ++i) blocks[b].params.emplace_back(sizes[(b + i) % 4], rng);
  }
  return blocks;
}

std::unique_ptr<OffloadPipeline> make_pipeline(UpdateEngine& engine, uint64_t d2h_fail_at = 0) {
  return std::make_unique<OffloadPipeline>(engine, std::make_unique<HostCopyQueue>(d2h_fail_at),
                                           std::make_unique<HostCopyQueue>());
}

}  // namespace

TEST(every_block_lands_updates_and_comes_back_exactly) {
  UpdateEngine engine(3, 4096, SimdPath::scalar);
  auto pipe = make_pipeline(engine);
  std::vector<Block> blocks = make_blocks(6, 1);
  std::mt19937 rng(2);
  for (int step = 0; step < 4; ++step) {
    // Backward order: the last block's gradients first; the next forward waits in forward order.
    for (int b = static_cast<int>(blocks.size()) - 1; b >= 0; --b) {
      for (Param& p : blocks[b].params) p.new_gradient(rng);
      pipe->stage(b, blocks[b].d2h(), blocks[b].jobs(1.0), blocks[b].h2d(), 0, false);
    }
    for (std::size_t b = 0; b < blocks.size(); ++b) {
      pipe->wait_ready(static_cast<int64_t>(b), 0);
      CHECK(!pipe->in_flight(static_cast<int64_t>(b)));
      for (Param& p : blocks[b].params) {
        p.reference_step(1.0);
        p.check_equal_to_reference();
      }
      const BlockPass info = pipe->last_pass(static_cast<int64_t>(b));
      CHECK(info.d2h_last >= info.d2h_first && info.d2h_first > 0);
      CHECK(info.h2d_last >= info.h2d_first && info.h2d_first > 0);
    }
  }
}

TEST(held_passes_release_with_a_multiplier_or_cancel) {
  UpdateEngine engine(2, 4096, SimdPath::scalar);
  auto pipe = make_pipeline(engine);
  std::vector<Block> blocks = make_blocks(2, 3);
  std::mt19937 rng(4);
  for (Block& blk : blocks)
    for (Param& p : blk.params) p.new_gradient(rng);
  // Block 0 is released with 0.25 (clipping), block 1 cancelled (a refused step).
  for (int b = 0; b < 2; ++b) pipe->stage(b, blocks[b].d2h(), blocks[b].jobs(1.0), blocks[b].h2d(), 0, true);
  CHECK_THROWS(pipe->wait_ready(0, 0));  // held and never released
  pipe->release(0, 0.25);
  pipe->cancel(1);
  CHECK_THROWS(pipe->release(1, 1.0));  // nothing held any more
  pipe->wait_ready(0, 0);
  pipe->wait_ready(1, 0);
  for (Param& p : blocks[0].params) {
    p.reference_step(0.25);
    p.check_equal_to_reference();
  }
  for (Param& p : blocks[1].params) {  // nothing written: the state and the weights are as before
    --p.step;
    p.check_equal_to_reference();
  }
}

TEST(a_block_staged_again_before_its_pass_was_consumed_waits_for_it) {
  // Three steps of one block with no wait_ready in between (no forward used the block). Each stage
  // must wait for the previous pass before its gradient copy overwrites the staging buffer that pass
  // reads and whose new weights it copies back.
  UpdateEngine engine(2, 4096, SimdPath::scalar);
  auto pipe = make_pipeline(engine);
  std::vector<Block> blocks = make_blocks(1, 5);
  Block& blk = blocks[0];
  std::mt19937 rng(6);
  std::vector<std::vector<std::vector<uint16_t>>> grads;  // [step][param]: each step's own tensors
  for (int step = 0; step < 3; ++step) {
    grads.emplace_back();
    std::vector<HostCopy> d2h;
    for (Param& p : blk.params) {
      p.new_gradient(rng);
      grads.back().push_back(p.grad);
    }
    for (std::size_t i = 0; i < blk.params.size(); ++i) {
      d2h.push_back({blk.params[i].staging.data(), grads.back()[i].data(), grads.back()[i].size() * 2});
    }
    std::vector<UpdateJob> jobs = blk.jobs(1.0);
    for (Param& p : blk.params) p.reference_step(1.0);
    pipe->stage(0, d2h, jobs, blk.h2d(), 0, false);
  }
  pipe->wait_ready(0, 0);
  for (Param& p : blk.params) p.check_equal_to_reference();
}

TEST(a_failed_copy_is_raised_in_the_waiting_thread_and_the_block_can_go_again) {
  UpdateEngine engine(2, 4096, SimdPath::scalar);
  auto pipe = make_pipeline(engine, /*d2h_fail_at=*/1);
  std::vector<Block> blocks = make_blocks(1, 7);
  pipe->stage(0, blocks[0].d2h(), blocks[0].jobs(1.0), blocks[0].h2d(), 0, false);
  bool raised = false;
  try {
    pipe->wait_ready(0, 0, 10.0);
  } catch (const Timeout&) {
    CHECK_MSG(false, "the failure was not noticed");
  } catch (const Error& e) {
    raised = std::string(e.what()).find("gradient copy (device to host) failed: injected") != std::string::npos;
  }
  CHECK(raised);
  CHECK(!pipe->in_flight(0));
}

TEST(a_streamed_block_writes_its_weights_on_the_host_and_copies_nothing_back) {
  // A streamed block's training copy lives in host memory: the update writes the new weights into a
  // host buffer of their own (not over the gradient staging) and the pass has no H2D copies. updated()
  // tells, without waiting or consuming the pass, when that buffer may be read.
  UpdateEngine engine(2, 4096, SimdPath::scalar);
  auto pipe = make_pipeline(engine);
  std::vector<Block> blocks = make_blocks(1, 9);
  Block& blk = blocks[0];
  std::mt19937 rng(10);
  std::vector<std::vector<uint16_t>> homes;
  for (Param& p : blk.params) homes.push_back(p.weight);
  CHECK(pipe->updated(0));  // nothing in flight
  for (int step = 0; step < 3; ++step) {
    std::vector<UpdateJob> jobs;
    for (std::size_t i = 0; i < blk.params.size(); ++i) {
      Param& p = blk.params[i];
      p.new_gradient(rng);
      ++p.step;
      UpdateJob j = p.job(1.0);
      j.tensor.param_copy = homes[i].data();
      jobs.push_back(j);
    }
    pipe->stage(0, blk.d2h(), jobs, {}, 0, true);
    CHECK(!pipe->updated(0));  // held
    pipe->release(0, 1.0);
    while (!pipe->updated(0)) std::this_thread::yield();
    for (std::size_t i = 0; i < blk.params.size(); ++i) {
      Param& p = blk.params[i];
      const std::vector<uint16_t> grad = p.grad;
      p.reference_step(1.0);
      CHECK(homes[i] == p.ref_weight);
      CHECK(p.staging == grad);  // the gradient staging is left as it landed
      CHECK(p.master == p.ref_master && p.m == p.ref_m && p.v == p.ref_v);
    }
    CHECK(pipe->in_flight(0));  // updated() did not consume the pass
    pipe->wait_ready(0, 0);
    const BlockPass info = pipe->last_pass(0);
    CHECK(info.h2d_first == 0 && info.h2d_last == 0 && info.h2d_bytes == 0);
    for (Param& p : blk.params) CHECK(p.weight != p.ref_weight);  // nothing was copied to the "device"
  }
}

HYTEST_MAIN()
