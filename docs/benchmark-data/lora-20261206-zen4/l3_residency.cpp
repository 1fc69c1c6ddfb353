// (docs/benchmarks.md, "LoRA adapters on an AMD EPYC (Zen 4)") Does streaming a big "base" with prefetchnta keep a small "adapter" resident in L3?
// Per "token": for 120 chunks: read base chunk (BASE/120 bytes), then read adapter chunk (AD/120).
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
__attribute__((noinline)) float sum_normal(const float* p, size_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (size_t i = 0; i < n; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + i));
  return _mm512_reduce_add_ps(acc);
}
__attribute__((noinline)) float sum_nta(const float* p, size_t n, size_t ahead) {
  __m512 acc = _mm512_setzero_ps();
  for (size_t i = 0; i < n; i += 16) {
    _mm_prefetch((const char*)(p + i + ahead), _MM_HINT_NTA);
    acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + i));
  }
  return _mm512_reduce_add_ps(acc);
}
__attribute__((noinline)) float sum_ad(const float* p, size_t n) {  // adapter read with a T1 prefetch 4 KB ahead
  __m512 acc = _mm512_setzero_ps();
  for (size_t i = 0; i < n; i += 16) {
    _mm_prefetch((const char*)(p + i + 1024), _MM_HINT_T0);
    acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + i));
  }
  return _mm512_reduce_add_ps(acc);
}
int main(int argc, char** argv) {
  int mode = atoi(argv[1]);  // 0 normal base, 1 nta base, 2 no base
  size_t ahead = argc > 2 ? atol(argv[2]) : 256;  // floats
  const size_t BASE = 96u << 20, AD = 10u << 20, CH = 120;
  std::vector<float> base(BASE / 4, 1.f), ad(AD / 4, 2.f);
  size_t bch = BASE / 4 / CH / 16 * 16, ach = AD / 4 / CH / 16 * 16;
  volatile float sink = 0;
  std::vector<double> tb, ta;
  for (int tok = 0; tok < 60; ++tok) {
    double t_base = 0, t_ad = 0;
    for (size_t c = 0; c < CH; ++c) {
      double t0 = now();
      if (mode == 0) sink += sum_normal(base.data() + c * bch, bch);
      else if (mode == 1) sink += sum_nta(base.data() + c * bch, bch, ahead);
      double t1 = now();
      sink += sum_ad(ad.data() + c * ach, ach);
      double t2 = now();
      t_base += t1 - t0; t_ad += t2 - t1;
    }
    if (tok >= 10) { tb.push_back(t_base); ta.push_back(t_ad); }
  }
  std::sort(tb.begin(), tb.end()); std::sort(ta.begin(), ta.end());
  printf("mode %d ahead %zu: base %.3f ms (%.1f GB/s), adapter %.3f ms (%.1f GB/s)\n", mode, ahead,
         tb[tb.size()/2]*1e3, BASE/tb[tb.size()/2]/1e9, ta[ta.size()/2]*1e3, AD/ta[ta.size()/2]/1e9);
}
