// Every operator of kvledger's CPU kernels, declared once; the kernels register in their own files.
#include "library.h"

KVLEDGER_LIBRARY(m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
        "Tensor context_lens, float scale, Tensor? k_scales=None, Tensor? v_scales=None, float k_scale=1.0, "
        "float v_scale=1.0) -> ()");
  m.def("paged_prefill(Tensor(a!) out, Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, "
        "int num_computed, float scale) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_width() -> int", &kvledger_cpu::panel_width);
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, Tensor? residual) -> Tensor");
}
