// A mixture of experts' router, torch-free (the core of kernels.h's moe_route): per token, the
// fp32 logits against every expert, a softmax over all of them and the top k, renormalised to
// sum 1 where the architecture says (model/moe.py SparseMoE.route). Every token's result
// depends only on its own row and the router, whatever the token count or the thread split:
// each logit is one expert row's dot product in an order fixed by the width alone.
#pragma once
#include <cstdint>

#include "simd.h"

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace route {

// x [T, D] (fp32, or bf16 as uint16_t: widened, exactly), router [E, D] fp32, 1 <= k <= E.
//   logit_e = Σ_i x_i·r_e,i in fp32 (32 inputs at a time into 4 vectors of 8 lanes by FMA,
//             the last < 32 through a zero-padded copy, then ((v0 + v1) + (v2 + v3)) summed
//             across lanes in simd::hsum8's order)
//   p_e     = e^(logit_e − max) / Σ_e' e^(logit_e' − max) (std::exp, the sum in expert order)
//   experts[t, 0..k): the k largest p, the largest first, an equal p: the lower expert first
//   weights[t, j]   = p of experts[t, j]; with renormalise divided by their sum (in rank order)
void route(const float* x, const float* router, int64_t T, int64_t D, int64_t E, int64_t k, bool renormalise,
           float* weights, int64_t* experts);
void route(const uint16_t* x, const float* router, int64_t T, int64_t D, int64_t E, int64_t k, bool renormalise,
           float* weights, int64_t* experts);

}  // namespace route
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
