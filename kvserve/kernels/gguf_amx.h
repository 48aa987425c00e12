// GGUF blocks times bf16 rows on AMX tiles (gguf_matmul.cpp includes this after its block
// decoding; activations "bf16"). A pair of 16-row tiles is decoded into B tiles whose values are
// gguf-py's float32 dequantization rounded to bf16 (to nearest even: what a bf16 copy of the
// weight holds), then multiplied by amx_core's tile steps. So every output equals
// kvserve_amx_matmul's on the weight dequantized and cast to bf16, bit for bit (a NaN weight's
// payload aside), while the weight stays in the file's bytes: the bf16 weights' products at the
// GGUF file's size. A tile pair is decoded once per chunk of rows (decode steps: once per call).

namespace tiles {

#if KVSERVE_AMX_SUPPORTED

using amx_core::kBlock;

// one B tile row: 16 columns' values at k = 2p (low half of each 32-bit lane) and 2p + 1 (high),
// rounded to bf16 to nearest even. VCVTNE2PS2BF16 flushes a denormal to zero where the integer
// rounding of amx_core::to_bf16 keeps a bf16 denormal, which TDPBF16PS reads as zero: the same
// products.
inline void put_pair(uint16_t* row, V16 even, V16 odd) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                              18, 2, 17, 1, 16, 0);
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd.v, even.v);  // even in the low 16 words, odd in the high
  _mm512_storeu_si512(row, _mm512_permutexvar_epi16(interleave, both));
#elif defined(__AVX512F__)
  const __m512i e = _mm512_castps_si512(even.v), o = _mm512_castps_si512(odd.v);
  const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
  const __m512i e_rounded = _mm512_srli_epi32(_mm512_add_epi32(e, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(e, 16), one))), 16);
  const __m512i o_rounded = _mm512_add_epi32(o, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(o, 16), one)));
  _mm512_storeu_si512(row, _mm512_or_si512(e_rounded, _mm512_and_si512(o_rounded, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))));
#else
  alignas(64) float e[kTile], o[kTile];
  put(e, 0, even);
  put(o, 0, odd);
  for (int i = 0; i < kTile; ++i) {
    row[2 * i] = amx_core::to_bf16(e[i]);
    row[2 * i + 1] = amx_core::to_bf16(o[i]);
  }
#endif
}

// one 16-row tile's k values into its B tiles, [k/2][16][2] bf16 (k/32 tiles of 1 KiB)
template <int T>
void decode_b_tiles(const uint8_t* tile, int k, uint16_t* b) {
  constexpr BlockShape shape = block_shape(T);
  constexpr int64_t block_bytes = static_cast<int64_t>(shape.bytes) * kTile;
  for (int blk = 0; blk < k / shape.values; ++blk) {
    uint16_t* out = b + static_cast<int64_t>(blk) * shape.values * kTile;
    V16 even{};
    dequantize_tile_block<T>(tile + blk * block_bytes, [&even, out](int l, V16 w) {
      if (l % 2 == 0) even = w;
      else put_pair(out + (l / 2) * 2 * kTile, even, w);
    });
  }
}

using BTileDecoder = void (*)(const uint8_t*, int, uint16_t*);

inline BTileDecoder b_tile_decoder(int type) {
  return for_type(type, BTileDecoder{}, [](auto t) -> BTileDecoder { return decode_b_tiles<decltype(t)::value>; });
}

// x: bf16 [rows, k] (row stride ldx); out ([rows, ldo] float32 or bf16) and argmax may be null
inline void run(const Weight& w, int type, const uint16_t* x, int64_t ldx, int rows, void* out, int out_dtype, int64_t ldo, int64_t* argmax) {
  amx_core::StagedRows staged;
  amx_core::stage_rows(x, ldx, rows, w.k, w.k / amx_core::kStep, staged);
  const BTileDecoder decode = b_tile_decoder(type);
  const int64_t pairs = ((w.n + kBlock - 1) / kBlock + 1) / 2;
  amx_core::run_pairs(pairs, rows, out, out_dtype, w.n, ldo, argmax, [&](int64_t begin, int64_t end, const amx_core::Outputs& o) {
    // each pair decoded once per chunk of rows (1 MiB of x)
    std::vector<uint16_t> panel(static_cast<size_t>(2) * w.k * kTile);
    amx_core::walk_pairs(staged, rows, w.k, (w.n + kBlock - 1) / kBlock, begin, end, 1 << 20, o, [&](int64_t cb, int nt) {
      for (int t = 0; t < nt; ++t) decode(w.tiles + (cb + t) * w.tile_bytes, w.k, panel.data() + static_cast<int64_t>(t) * w.k * kTile);
      return static_cast<const uint16_t*>(panel.data());
    });
  });
}

#endif  // KVSERVE_AMX_SUPPORTED

}  // namespace tiles
