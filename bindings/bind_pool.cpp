// PinnedPool and its allocations (torch views over pool memory keep their block alive).
#include <cstdint>

#include "common.h"
#include "hytrain/error.h"
#include "hytrain/numa.h"

namespace hytrain {
namespace bindings {

namespace {

// One block of pool memory, exposed to Python through the buffer protocol; torch.frombuffer keeps a
// reference to it, so the block returns to the pool only after the last tensor view is gone.
struct Allocation {
  Allocation(std::shared_ptr<PinnedPool> p, void* mem, std::size_t n, bool z)
      : pool(std::move(p)), ptr(mem), nbytes(n), zeroed(z) {}
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;
  ~Allocation() { pool->free(ptr); }

  std::shared_ptr<PinnedPool> pool;
  void* ptr;
  std::size_t nbytes;
  bool zeroed;  // known to read as zeros (memory the pool has not handed out before)
};

py::dict stats_dict(const PoolStats& s) {
  py::dict d;
  d["capacity"] = s.capacity;
  d["reserved"] = s.reserved;
  d["in_use"] = s.in_use;
  d["peak_in_use"] = s.peak_in_use;
  d["slabs"] = s.slabs;
  d["allocations"] = s.allocations;
  d["largest_free"] = s.largest_free;
  return d;
}

std::shared_ptr<PinnedPool> make_pool(std::size_t capacity, std::size_t slab_bytes, bool pinned,
                                      std::size_t alignment) {
  std::unique_ptr<HostAllocator> alloc;
  if (pinned) alloc = make_page_locked_allocator();
  if (!alloc) alloc = make_page_aligned_allocator();
  return std::make_shared<PinnedPool>(std::move(alloc), capacity, slab_bytes, alignment);
}

}  // namespace

void bind_pool(py::module_& m) {
  m.def("numa_nodes", [] {
        py::list out;
        for (const auto& n : numa_nodes_of_affinity()) {
          py::dict d;
          d["id"] = n.id;
          d["cpus"] = n.cpus;
          out.append(d);
        }
        return out;
      },
      "The NUMA nodes with CPUs this process may run on: [{'id', 'cpus'}] (empty where sysfs does not say).");
  m.def("page_placement", [] { return std::string(page_placement_name(page_placement())); },
        "How new pool slabs are placed: 'spread' over the NUMA nodes or 'local' (HYTRAIN_PAGE_PLACEMENT).");
  py::class_<Allocation, std::shared_ptr<Allocation>>(m, "Allocation", py::buffer_protocol())
      .def_property_readonly("ptr", [](const Allocation& a) {
        return reinterpret_cast<std::uintptr_t>(a.ptr);
      })
      .def_property_readonly("nbytes", [](const Allocation& a) { return a.nbytes; })
      .def_property_readonly("zeroed", [](const Allocation& a) { return a.zeroed; })
      .def_buffer([](Allocation& a) {
        return py::buffer_info(a.ptr, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(a.nbytes)}, {1}, false);
      });

  py::class_<PinnedPool, std::shared_ptr<PinnedPool>>(m, "PinnedPool")
      .def(py::init(&make_pool), py::arg("capacity_bytes"), py::arg("slab_bytes"),
           py::arg("pinned"), py::arg("alignment") = PinnedPool::kDefaultAlignment)
      .def(
          "allocate",
          [](std::shared_ptr<PinnedPool> self, std::size_t nbytes) {
            bool zeroed = false;
            void* p = self->allocate(nbytes, &zeroed);
            return std::make_shared<Allocation>(self, p, nbytes, zeroed);
          },
          py::arg("nbytes"))
      .def("stats", [](const PinnedPool& p) { return stats_dict(p.stats()); })
      .def("trim", &PinnedPool::trim, py::call_guard<py::gil_scoped_release>())
      .def("reserve", &PinnedPool::reserve, py::arg("slab_sizes"), py::arg("threads"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("kind", &PinnedPool::kind)
      .def_property_readonly("page_locked", &PinnedPool::page_locked)
      .def_property_readonly("alignment", &PinnedPool::alignment);
}

}  // namespace bindings
}  // namespace hytrain
