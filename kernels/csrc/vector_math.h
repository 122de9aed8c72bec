// Scalar helpers written so the compiler vectorizes the loops that call them (libm's expf
// stays scalar under this build's flags): e^x for the softmax and SiLU, bfloat16 <-> float32.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// e^x for x <= 0 (softmax after subtracting the peak), vectorizable: x = n ln 2 + r with
// ln 2 in two parts (Cody-Waite), e^r by its Taylor series to r^7 (|r| <= ln 2 / 2), times 2^n
// by the exponent bits. Relative error under 1.1e-7 over [-87, 0] (expf's float rounding).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// bfloat16 is float32's upper 16 bits: widening is a shift; narrowing rounds to nearest even
// (NaN is not produced by the products it narrows, so not special-cased).
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline uint16_t float_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Elements of float32 or bfloat16 (uint16_t) arrays, read and written as float32.
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16(v); }

// x / (1 + e^-x) (torch's formula) for x >= 0; x e^x / (1 + e^x) below, so e^-x never
// overflows (and e^x is 0 where float32's e^-x would be inf, as torch's result is then)
inline float silu(float x) {
  const float e = x < -87.f ? 0.f : exp_nonpositive(-std::fabs(x));
  return (x >= 0.f ? x : x * e) / (1.f + e);
}
