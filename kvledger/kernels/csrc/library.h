// How kvledger's CPU kernels register: one operator namespace per build. The kernels are built
// once per vector capability (AVX2, AVX-512; kvledger.kernels.cpu_kernels), and every build names
// its namespace in KVLEDGER_OPS (kvledger_cpu_avx2, kvledger_cpu_avx512), so that the builds of
// two capabilities load side by side in one process and the tests run both on a machine that has
// both. ops.cpp declares every operator's schema; each kernel's file registers its CPU kernel with
// KVLEDGER_IMPL.
#pragma once

#include <torch/library.h>

#include <cstdint>

#ifndef KVLEDGER_OPS
#error "build with -DKVLEDGER_OPS=<operator namespace> (kvledger.kernels.cpu_kernels does)"
#endif
#if !defined(CPU_CAPABILITY_AVX512) && !defined(CPU_CAPABILITY_AVX2)
#error "kvledger's CPU kernels are built for AVX2 or AVX-512 (CPU_CAPABILITY_AVX2 / CPU_CAPABILITY_AVX512)"
#endif

// The namespace is expanded before TORCH_LIBRARY pastes it into its names.
#define KVLEDGER_LIBRARY_(ns, m) TORCH_LIBRARY(ns, m)
#define KVLEDGER_LIBRARY(m) KVLEDGER_LIBRARY_(KVLEDGER_OPS, m)
#define KVLEDGER_IMPL_(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)
#define KVLEDGER_IMPL(m) KVLEDGER_IMPL_(KVLEDGER_OPS, m)

namespace kvledger_cpu {
// The one dtype dispatch of the kernels: calls fn(T{}) with T the C++ type of `dtype`, float or
// c10::BFloat16 (the two they compute in); any other dtype fails with `op` named.
template <typename Fn>
void dispatch_float(c10::ScalarType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case c10::ScalarType::Float: fn(float{}); return;
    case c10::ScalarType::BFloat16: fn(c10::BFloat16{}); return;
    default: TORCH_CHECK(false, op, ": float32 or bfloat16 only, got ", dtype);
  }
}

// Output columns per panel of pack_panels' layout (two vectors of floats), in panel_linear.cpp.
int64_t panel_width();
}  // namespace kvledger_cpu
