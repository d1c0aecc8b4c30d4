// BlockRuntime: the phase machine of a step (arrivals with accumulation, hand-offs, launches, a step
// not taken), refused transitions, the launch order, migrations that wait for a pass in flight, and
// the shadow plan (donors by signature, the room for new shadows, the stop at a resident block).
#include <cstdint>
#include <vector>

#include "check.h"
#include "hytrain/block_runtime.h"
#include "hytrain/error.h"

using namespace hytrain;

namespace {

template <class F>
bool throws(F f) {
  try {
    f();
  } catch (const Error&) {
    return true;
  }
  return false;
}

TEST(arrivals_complete_after_every_micro_batch) {
  BlockRuntime rt({2, 1, 3}, 2);
  CHECK(!rt.any_arrived());
  CHECK(rt.arrive(1) == Arrival::counted);
  CHECK(rt.phase(1) == BlockPhase::arriving);
  CHECK(rt.arrive(1) == Arrival::complete);  // 1 parameter x 2 micro-batches
  CHECK(rt.phase(1) == BlockPhase::complete);
  for (int i = 0; i < 3; ++i) CHECK(rt.arrive(0) == Arrival::counted);
  CHECK(rt.arrive(0) == Arrival::complete);
  CHECK(rt.arrivals(0) == 4);
  rt.launch(1);
  CHECK(rt.arrive(1) == Arrival::late);  // a gradient after the block was launched
  CHECK(rt.arrivals(1) == 2);
  rt.hold(0, {4, 5});
  CHECK((rt.handed(0) == std::vector<int64_t>{4, 5}));
  CHECK(rt.arrive(0) == Arrival::late);
  CHECK(rt.any_submitted() && rt.submitted(0) && !rt.submitted(2));
  CHECK(throws([&] { rt.end_step(); }));  // block 0 is still held
  rt.launch(0);
  rt.launch(2);  // never arrived: launched in step()
  rt.end_step();
  CHECK(rt.handed(0).empty());
  for (int b = 0; b < 3; ++b) CHECK(rt.phase(b) == BlockPhase::idle && rt.arrivals(b) == 0);
}

TEST(transitions_are_checked) {
  BlockRuntime rt({1, 1}, 1);
  CHECK(throws([&] { rt.hold(0, {}); }));       // gradients not complete
  CHECK(throws([&] { rt.speculate(0, {}); }));
  CHECK(throws([&] { rt.drop(0); }));       // nothing held
  CHECK(throws([&] { rt.phase(2); }));      // no such block
  CHECK(throws([] { BlockRuntime({}, 1); }));
  CHECK(throws([] { BlockRuntime({0}, 1); }));
  CHECK(throws([] { BlockRuntime({1}, 0); }));
  rt.arrive(0);
  rt.speculate(0, {0});
  CHECK(throws([&] { rt.hold(0, {0}); }));
  rt.drop(0);
  CHECK(rt.handed(0).empty());                                // a step not taken
  CHECK(rt.phase(0) == BlockPhase::idle);
  rt.launch(0);
  CHECK(throws([&] { rt.launch(0); }));      // launched twice
  // A GPU-resident block does not speculate.
  rt.end_step();
  rt.migrate(1);
  rt.moved_up(0);
  rt.arrive(0);
  CHECK(throws([&] { rt.speculate(0, {0}); }));
  rt.hold(0, {0});
  rt.abandon_step();
  CHECK(rt.phase(0) == BlockPhase::idle);
}

TEST(launch_order_offloaded_first) {
  BlockRuntime rt({1, 1, 1, 1}, 1);
  auto plan = rt.migrate(2);
  CHECK((plan.up == std::vector<int64_t>{0, 1}) && plan.down.empty());
  rt.moved_up(0);
  rt.moved_up(1);
  CHECK((rt.launch_order() == std::vector<int64_t>{2, 3, 0, 1}));
  CHECK((rt.resident() == std::vector<int64_t>{0, 1}));
}

TEST(migrations_wait_for_passes_in_flight) {
  BlockRuntime rt({1, 1, 1}, 1);
  rt.set_in_flight(0);
  rt.set_in_flight(2);
  auto plan = rt.migrate(2);
  CHECK((plan.up == std::vector<int64_t>{1}));  // block 0's pass is in flight: it goes up after it
  CHECK(rt.moving_up_later(0));
  CHECK(throws([&] { rt.moved_up(0); }));
  rt.moved_up(1);
  CHECK(rt.take_up().empty());
  CHECK(!rt.landed(2));
  CHECK(rt.landed(0));                           // waited for: now it may go up
  CHECK((rt.take_up() == std::vector<int64_t>{0}));
  rt.moved_up(0);
  CHECK(!rt.moving_up_later(0));
  // k falls: resident blocks come down; a pending move up is forgotten.
  rt.set_in_flight(2);
  plan = rt.migrate(3);
  CHECK(plan.up.empty() && rt.moving_up_later(2));
  plan = rt.migrate(1);
  CHECK((plan.down == std::vector<int64_t>{1}) && !rt.moving_up_later(2));
  rt.moved_down(1);
  CHECK((rt.resident() == std::vector<int64_t>{0}));
  CHECK(throws([&] { rt.migrate(4); }));
}

TEST(shadow_plan_allocates_within_room) {
  // 6 blocks; 0 and 1 GPU-resident (no shadows: they update on the GPU).
  BlockRuntime rt({1, 1, 1, 1, 1, 1}, 1);
  rt.migrate(2);
  rt.moved_up(0);
  rt.moved_up(1);
  const std::vector<int64_t> bytes = {0, 0, 100, 100, 100, 100};
  std::vector<bool> has(6, false);
  // Room for two new sets: 5 and 4 allocate, 3 cannot.
  auto plan = rt.plan_shadows(0, has, bytes, 250);
  CHECK((plan == std::vector<int64_t>{5, 4}));
  // Blocks that have shadows cost nothing; the plan stops at the first resident block.
  has = {false, false, true, true, true, true};
  plan = rt.plan_shadows(0, has, bytes, 0);
  CHECK((plan == std::vector<int64_t>{5, 4, 3, 2}));
  // lowest_start bounds it.
  has.assign(6, false);
  plan = rt.plan_shadows(4, has, bytes, 1000);
  CHECK((plan == std::vector<int64_t>{5, 4}));
  CHECK(throws([&] { rt.plan_shadows(0, {true}, bytes, 0); }));
}

}  // namespace

int main() { return hytest::run_all(); }
