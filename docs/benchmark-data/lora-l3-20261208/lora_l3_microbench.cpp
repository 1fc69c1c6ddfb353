// microbench: 30 SmolLM2 layers, one row, one adapter of rank 16, base reads between calls.
// Built beside actorlm_abi.h and dtype.h:
//   g++ -O3 -march=native -ffast-math -fopenmp -std=c++17 -I. \
//       -DLORA_SRC='"actorlm/kernels/cpu/csrc/lora.cpp"' lora_l3_microbench.cpp -o mb
// ./mb TOKENS WITH_BASE BASE_SCALE USE_LORA MODE: BASE_SCALE times SmolLM2's base bytes a
// layer; MODE 0 the adapter's calls, 1 each call's tables flushed after it (clflushopt),
// 2 a plain read of the same bytes instead of the calls, 3 a 5.8 us spin instead.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <immintrin.h>
#include <omp.h>
#include LORA_SRC

static float sink;
// a base GEMV's bytes read by the team (evicts caches as the real one does)
static void base_read(const char* p, size_t bytes) {
  float total = 0;
#pragma omp parallel for reduction(+ : total) schedule(static)
  for (size_t i = 0; i < bytes; i += 64) {
    __m512 v = _mm512_loadu_ps((const float*)(p + i));
    total += _mm512_reduce_add_ps(v);
  }
  sink += total;
}

struct Proj { int64_t in, out; int parts; std::vector<int64_t> ends; size_t base_bytes; };

int main(int argc, char** argv) {
  const int layers = 30, rank = 16, tokens = argc > 1 ? atoi(argv[1]) : 200;
  const bool with_base = argc > 2 ? atoi(argv[2]) : 1;
  const bool use_lora = argc > 4 ? atoi(argv[4]) : 1;
  const int flush_mode = argc > 5 ? atoi(argv[5]) : 0;
  std::vector<Proj> projs = {
    {576, 960, 3, {576, 768, 960}, 345600}, {576, 576, 1, {576}, 207360},
    {576, 3072, 2, {1536, 3072}, 1105920}, {1536, 576, 1, {576}, 552960}};
  std::vector<std::vector<uint16_t>> as, bs;
  std::vector<actorlm_lora> ls;
  srand(1);
  for (int L = 0; L < layers; ++L)
    for (auto& p : projs) {
      int r = rank * p.parts;
      as.emplace_back(size_t(r) * p.in); bs.emplace_back(size_t(r) * p.out);
      for (auto& v : as.back()) v = 0x3c00 + rand() % 64;
      for (auto& v : bs.back()) v = 0x3c00 + rand() % 64;
    }
  int k = 0;
  for (int L = 0; L < layers; ++L)
    for (auto& p : projs) {
      ls.push_back({as[k].data(), bs[k].data(), rank * p.parts, p.parts, p.ends.data()}); ++k;
    }
  const double scale = argc > 3 ? atof(argv[3]) : 1.0; for (auto& p : projs) p.base_bytes = size_t(p.base_bytes * scale) / 64 * 64;
  size_t base_total = 0; for (auto& p : projs) base_total += p.base_bytes;
  std::vector<char> base(base_total * layers + (1 << 20), 1);
  std::vector<uint16_t> x(4096, 0x3f80), y(4096, 0);
  int32_t slot = 0;
  double lora_s = 0, all_s = 0;
  std::vector<double> per_token;
  for (int t = 0; t < tokens; ++t) {
    auto t0 = std::chrono::steady_clock::now();
    double lt = 0; static double per[4]; static int cnt;
    size_t off = 0; k = 0;
    for (int L = 0; L < layers; ++L)
      for (auto& p : projs) {
        if (with_base) base_read(base.data() + off, p.base_bytes);
        off += p.base_bytes;
        auto a0 = std::chrono::steady_clock::now();
        if (use_lora && flush_mode < 2) actorlm_lora_add_bf16(&ls[k], x.data(), p.in, y.data(), p.out, 1, p.in, p.out, &slot);
        if (flush_mode == 2) {  // plain read of the same bytes instead
          base_read((const char*)ls[k].a, as[k].size()*2 / 64 * 64);
          base_read((const char*)ls[k].b, bs[k].size()*2 / 64 * 64);
        } else if (flush_mode == 3) {  // spin ~5.8 us
          auto s0 = std::chrono::steady_clock::now();
          while (std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count() < 5.8e-6) {}
        } else if (flush_mode) {
          const char* pa = (const char*)ls[k].a; size_t na = as[k].size()*2;
          const char* pb = (const char*)ls[k].b; size_t nb = bs[k].size()*2;
          for (size_t i = 0; i < na; i += 64) _mm_clflushopt((void*)(pa + i));
          for (size_t i = 0; i < nb; i += 64) _mm_clflushopt((void*)(pb + i));
        }
        double d = std::chrono::duration<double>(std::chrono::steady_clock::now() - a0).count(); lt += d; if (t >= 20) per[k % 4] += d;
        ++k;
      }
    if (t == tokens - 1) printf("per proj ms/token: %.3f %.3f %.3f %.3f\n", per[0]*1e3/(tokens-20), per[1]*1e3/(tokens-20), per[2]*1e3/(tokens-20), per[3]*1e3/(tokens-20));
    if (t >= 20) { per_token.push_back(lt); all_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
  }
  std::sort(per_token.begin(), per_token.end());
  printf("lora per token: median %.3f ms  p10 %.3f  p90 %.3f ; whole token %.3f ms\n",
         per_token[per_token.size() / 2] * 1e3, per_token[per_token.size() / 10] * 1e3,
         per_token[per_token.size() * 9 / 10] * 1e3, all_s / per_token.size() * 1e3);
}
