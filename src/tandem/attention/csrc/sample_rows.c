/* One token per row of fp32 logits: the sampler's draw (worker/sampler.py) in a few passes
   over each row, where torch makes a dozen (division, topk, logsumexp, softmax, cumsum, each
   over a fresh copy of the batch's logits).

   A row with temperature 0 takes its argmax (the first, as torch's). The others: temperature,
   then min-p, top-k and top-p in vLLM's order (top-p weighs what min-p and top-k leave), then
   one draw: the first token, in vocabulary order, whose running kept mass exceeds u times the
   whole kept mass (u in [0, 1) given per row, so seeded rows draw from their own generator).

   Per row: its max; with top-p, the whole row's mass (vectorized); then the candidates, the
   tokens within DELTA of the max (a compare per 16 tokens with AVX-512, per 8 with AVX2),
   among which the cuts are found: top-k's floor by a selection, top-p's by sorting only the
   bands of the candidates its cut can fall in. The kept set must lie within the candidates:
   where it may not (top-k's k-th token below them, or the mass top-p needs beyond them) the
   threshold goes lower and the candidates are collected again, down to the whole row. So the
   kept set is the sort's (the sampler's oracle) up to float rounding of the running mass right
   at p. A row with no cut draws over the whole row, a block of exps at a time. */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "vector_math.h"

#define DELTA 10.0f  /* first candidates: within e^-10 of the most likely token */
#define STEP 2.0f    /* then the threshold goes down by this much at a time (few more join) */
#define LOWEST 80.0f /* below the max by more than this, the candidates are the whole row */
#define DRAW_BLOCK 64 /* tokens whose exps are summed at once in a whole-row draw */
#define BAND 1.0f     /* top-p sorts only the bands of this width (below the max) it needs */
#define BANDS 32

typedef struct {
    float value; /* logit / T */
    int32_t index;
} candidate;

static int by_value_descending(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    if (x->value != y->value) return x->value > y->value ? -1 : 1;
    return x->index < y->index ? -1 : (x->index > y->index);
}

static float row_max(const float *x, int64_t vocab) {
    int64_t i = 0;
    float max = -INFINITY;
#if defined(__AVX512F__)
    __m512 vector_max = _mm512_set1_ps(-INFINITY);
    /* max_ps returns its second operand where either is NaN: NaN logits are skipped, as the
       scalar loop below skips them. */
    for (; i + 16 <= vocab; i += 16) vector_max = _mm512_max_ps(_mm512_loadu_ps(x + i), vector_max);
    max = _mm512_reduce_max_ps(vector_max);
#elif defined(__AVX2__)
    __m256 vector_max[2] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY)};
    for (; i + 16 <= vocab; i += 16)
        for (int h = 0; h < 2; h++)
            vector_max[h] = _mm256_max_ps(_mm256_loadu_ps(x + i + 8 * h), vector_max[h]);
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(vector_max[0], vector_max[1]));
    for (int lane = 0; lane < 8; lane++) max = lanes[lane] > max ? lanes[lane] : max;
#endif
    for (; i < vocab; i++) max = x[i] > max ? x[i] : max;
    return max;
}

/* Σ e^(x·inverse_t − top) over x[0 .. count). */
static float mass(const float *x, int64_t count, float inverse_t, float top) {
    float sum = 0.0f;
    for (int64_t i = 0; i < count; i++) sum += exp_nonpositive(x[i] * inverse_t - top);
    return sum;
}

/* The tokens whose scaled logit is at least `threshold`, in vocabulary order. */
static int64_t collect(const float *x, int64_t vocab, float inverse_t, float threshold,
                       candidate *out) {
    int64_t count = 0, i = 0;
#if defined(__AVX512F__)
    const __m512 scale = _mm512_set1_ps(inverse_t), limit = _mm512_set1_ps(threshold);
    const __m512 minus_infinity = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= vocab; i += 16) { /* a compare per 16 tokens; few lanes pass */
        const __m512 raw = _mm512_loadu_ps(x + i);
        unsigned mask = _mm512_cmp_ps_mask(_mm512_mul_ps(raw, scale), limit, _CMP_GE_OQ) &
                        _mm512_cmp_ps_mask(raw, minus_infinity, _CMP_GT_OQ);
        for (; mask; mask &= mask - 1) {
            const int64_t j = i + __builtin_ctz(mask);
            out[count].value = x[j] * inverse_t;
            out[count++].index = (int32_t)j;
        }
    }
#elif defined(__AVX2__)
    const __m256 scale = _mm256_set1_ps(inverse_t), limit = _mm256_set1_ps(threshold);
    const __m256 minus_infinity = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= vocab; i += 8) {
        const __m256 raw = _mm256_loadu_ps(x + i);
        const __m256 kept =
            _mm256_and_ps(_mm256_cmp_ps(_mm256_mul_ps(raw, scale), limit, _CMP_GE_OQ),
                          _mm256_cmp_ps(raw, minus_infinity, _CMP_GT_OQ));
        for (unsigned mask = (unsigned)_mm256_movemask_ps(kept); mask; mask &= mask - 1) {
            const int64_t j = i + __builtin_ctz(mask);
            out[count].value = x[j] * inverse_t;
            out[count++].index = (int32_t)j;
        }
    }
#endif
    for (; i < vocab; i++) {
        const float value = x[i] * inverse_t;
        if (value >= threshold && x[i] > -INFINITY) {
            out[count].value = value;
            out[count++].index = (int32_t)i;
        }
    }
    return count;
}

/* The k-th largest of values[0 .. count) (k <= count), reordering them: a selection, not a
   sort (Hoare's partition around the middle value). */
static float kth_largest(float *values, int64_t count, int64_t k) {
    int64_t low = 0, high = count - 1;
    const int64_t target = k - 1;
    while (low < high) {
        const float pivot = values[low + (high - low) / 2];
        int64_t i = low, j = high;
        while (i <= j) {
            while (values[i] > pivot) i++;
            while (values[j] < pivot) j--;
            if (i <= j) {
                const float swap = values[i];
                values[i++] = values[j];
                values[j--] = swap;
            }
        }
        if (target <= j) high = j;
        else if (target >= i) low = i;
        else return values[target];
    }
    return values[target];
}

/* The draw over the whole row (no cut): block sums first, then the block it falls in. */
static int64_t draw_whole_row(const float *x, int64_t vocab, float inverse_t, float top,
                              float total, float u) {
    const float target = u * total;
    float running = 0.0f;
    int64_t last = 0;
    for (int64_t start = 0; start < vocab; start += DRAW_BLOCK) {
        const int64_t size = vocab - start < DRAW_BLOCK ? vocab - start : DRAW_BLOCK;
        const float block = mass(x + start, size, inverse_t, top);
        if (running + block <= target) {
            running += block;
            continue;
        }
        for (int64_t i = start; i < start + size; i++) {
            if (x[i] == -INFINITY) continue;
            running += exp_nonpositive(x[i] * inverse_t - top);
            last = i;
            if (running > target) return i;
        }
    }
    for (int64_t i = vocab - 1; i >= 0; i--) /* rounding left the target unreached */
        if (x[i] > -INFINITY) return i;
    return last;
}

/* Top-p's floor among `count` candidates (in vocabulary order) over what min-p and top-k
   leave (the candidates at or above floor_before): the value of the last token kept, which
   is the first plus every token while the mass before it is below p of `normalizer` (the
   whole row's mass `row_mass` where nothing came before). NAN where top-p alone needs more
   mass than the candidates hold: the caller collects more. */
static float top_p_floor(const candidate *in_order, int64_t count, float top, float top_p,
                         float floor_before, float row_mass, candidate *sorted) {
    /* Mass per band of BAND below the top: only the bands the cut can fall in are sorted. */
    float band_mass[BANDS] = {0.0f}, candidate_mass = 0.0f;
    for (int64_t c = 0; c < count; c++) {
        const float value = in_order[c].value;
        if (value < floor_before) continue;
        const float e = exp_nonpositive(value - top);
        const float below = (top - value) * (1.0f / BAND); /* huge for -1e30 masks */
        band_mass[below < (float)(BANDS - 1) ? (int64_t)below : BANDS - 1] += e;
        candidate_mass += e;
    }
    const int alone = floor_before == -INFINITY;
    const float needed = top_p * (alone ? row_mass : candidate_mass);
    if (alone && candidate_mass < needed) return NAN;
    float band_running = 0.0f;
    int64_t last_band = 0;
    while (last_band < BANDS - 1 && band_running + band_mass[last_band] < needed)
        band_running += band_mass[last_band++];
    const float band_floor = last_band < BANDS - 1 ? top - BAND * (last_band + 1) : -INFINITY;
    int64_t num_sorted = 0;
    for (int64_t c = 0; c < count; c++)
        if (in_order[c].value >= floor_before && in_order[c].value >= band_floor)
            sorted[num_sorted++] = in_order[c];
    qsort(sorted, (size_t)num_sorted, sizeof(candidate), by_value_descending);
    float running = 0.0f;
    int64_t kept = 0;
    while (kept < num_sorted && (kept == 0 || running < needed))
        running += exp_nonpositive(sorted[kept++].value - top);
    if (running < needed && alone && band_floor == -INFINITY)
        return NAN; /* float rounding: the set reaches past the candidates */
    return sorted[kept - 1].value;
}

/* The first index where x equals max (-1 where none does). The compare runs a vector at a
   time: a loop that exits early is not vectorized by the compiler, and a greedy row's scan was
   half of its argmax. */
static int64_t first_index_of(const float *x, int64_t vocab, float max) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 target = _mm512_set1_ps(max);
    for (; i + 16 <= vocab; i += 16) {
        const __mmask16 equal = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
        if (equal) return i + __builtin_ctz(equal);
    }
#elif defined(__AVX2__)
    const __m256 target = _mm256_set1_ps(max);
    for (; i + 8 <= vocab; i += 8) {
        const int equal =
            _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
        if (equal) return i + __builtin_ctz(equal);
    }
#endif
    for (; i < vocab; i++)
        if (x[i] == max) return i;
    return -1;
}

/* The first index where x equals max (0 where none does: every logit NaN). */
static int64_t first_max(const float *x, int64_t vocab, float max) {
    const int64_t index = first_index_of(x, vocab, max);
    return index < 0 ? 0 : index;
}

/* x[start .. end)'s largest number (NaN skipped; -inf where there is none) in *max, and the
   first index holding it in *at (-1 where none does): argmax_rows' answer for a slice. */
static void slice_argmax(const float *x, int64_t start, int64_t end, float *max, int64_t *at) {
    *max = end > start ? row_max(x + start, end - start) : -INFINITY;
    const int64_t index = end > start ? first_index_of(x + start, end - start, *max) : -1;
    *at = index < 0 ? -1 : start + index;
}

int64_t row_groups_argmax(int64_t n_out, int64_t group_rows, float *out,
                          void (*compute)(const void *context, int64_t group),
                          const void *context, int num_threads) {
    const int64_t groups = (n_out + group_rows - 1) / group_rows;
    float best[num_threads];
    int64_t best_at[num_threads];
    int team = 1;
    #pragma omp parallel num_threads(num_threads)
    {
        const int thread = omp_get_thread_num(), count = omp_get_num_threads();
        if (thread == 0) team = count;
        const int64_t first = groups * thread / count, last = groups * (thread + 1) / count;
        for (int64_t n = first; n < last; n++) compute(context, n);
        const int64_t end = last * group_rows < n_out ? last * group_rows : n_out;
        slice_argmax(out, first * group_rows, end, &best[thread], &best_at[thread]);
    }
    float max = -INFINITY; /* the slices' answers, merged in column order */
    for (int t = 0; t < team; t++) max = best[t] > max ? best[t] : max;
    for (int t = 0; t < team; t++)
        if (best_at[t] >= 0 && best[t] == max) return best_at[t];
    return 0; /* every value NaN */
}

static int64_t sample_row(const float *x, int64_t vocab, float temperature, int64_t top_k,
                          float top_p, float min_p, float u, candidate *in_order,
                          candidate *sorted) {
    const float max = row_max(x, vocab);
    if (temperature == 0.0f || !isfinite(max)) return first_max(x, vocab, max);
    const float inverse_t = 1.0f / temperature, top = max * inverse_t;
    if (!isfinite(top)) return first_max(x, vocab, max); /* no finite distribution to draw */
    const int k_on = top_k > 0 && top_k < vocab;
    const float min_floor = min_p > 0.0f ? top + logf(min_p) : -INFINITY;
    const int no_cut = !k_on && min_p <= 0.0f && top_p >= 1.0f;
    const float row_mass = top_p < 1.0f || no_cut ? mass(x, vocab, inverse_t, top) : 0.0f;
    if (no_cut) return draw_whole_row(x, vocab, inverse_t, top, row_mass, u);
    float threshold = top - DELTA; /* min-p's whole set among the first candidates: */
    if (min_floor > -INFINITY && min_floor - 1.0f < threshold) threshold = min_floor - 1.0f;
    for (;;) {
        const int whole_row = threshold == -INFINITY;
        const int64_t count = collect(x, vocab, inverse_t, threshold, in_order);
        if (count == 0) return first_max(x, vocab, max); /* (the max itself always passes) */
        float lower = threshold - STEP; /* (where STEP is lost to rounding: the whole row) */
        lower = lower < top - LOWEST || !(lower < threshold) ? -INFINITY : lower;
        if (!whole_row && k_on && count < top_k) {
            threshold = lower; /* the k-th largest is below the candidates */
            continue;
        }
        /* What min-p and top-k leave: every token at or above floor_before (all candidates:
           min-p's floor is above the threshold, and top-k's k-th token is a candidate). */
        float floor_before = min_floor;
        if (k_on && count >= top_k) { /* (fewer only in a row of fewer finite tokens) */
            float *values = (float *)sorted; /* scratch */
            for (int64_t c = 0; c < count; c++) values[c] = in_order[c].value;
            const float kth = kth_largest(values, count, top_k);
            floor_before = kth > floor_before ? kth : floor_before;
        }
        float floor = floor_before;
        if (top_p < 1.0f) {
            const float floor_p =
                top_p_floor(in_order, count, top, top_p, floor_before, row_mass, sorted);
            if (isnan(floor_p) && !whole_row) {
                threshold = lower; /* the kept set reaches past the candidates */
                continue;
            }
            if (floor_p > floor) floor = floor_p;
        }
        /* The draw, over the kept candidates in vocabulary order. */
        float kept_mass = 0.0f;
        for (int64_t c = 0; c < count; c++)
            if (in_order[c].value >= floor) kept_mass += exp_nonpositive(in_order[c].value - top);
        const float target = u * kept_mass;
        float running = 0.0f;
        int64_t last = in_order[0].index;
        for (int64_t c = 0; c < count; c++) {
            if (in_order[c].value < floor) continue;
            running += exp_nonpositive(in_order[c].value - top);
            last = in_order[c].index;
            if (running > target) return last;
        }
        return last; /* rounding left the target unreached: the last kept token */
    }
}

/* tokens[r] for each row of logits [rows, vocab] (contiguous): temperature[r] 0 for argmax,
   top_k[r] 0 (or >= vocab) for none, top_p[r] 1 for none, min_p[r] 0 for none, u[r] in
   [0, 1). `scratch`: 2 * vocab candidates per thread (the caller's memory: nothing here can
   fail). */
void sample_rows(const float *logits, int64_t rows, int64_t vocab, const float *temperature,
                 const int64_t *top_k, const float *top_p, const float *min_p, const float *u,
                 int64_t *tokens, void *scratch, int num_threads) {
    #pragma omp parallel num_threads(num_threads) if(rows > 1)
    {
        candidate *in_order = (candidate *)scratch + 2 * vocab * omp_get_thread_num();
        candidate *sorted = in_order + vocab;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++)
            tokens[r] = sample_row(logits + r * vocab, vocab, temperature[r], top_k[r], top_p[r],
                                   min_p[r], u[r], in_order, sorted);
    }
}

/* Structured outputs: in each listed row of logits [*, vocab] (contiguous), -inf for every
   token whose bit is clear in the row's int32 bitmask [words] (bit i % 32 of word i / 32:
   xgrammar's layout). A grammar's words are mostly all set or all clear, so each is looked at
   whole first. */
void mask_rows(float *logits, int64_t vocab, const int64_t *rows, int64_t num_rows,
               const int32_t *bitmask, int64_t words) {
    for (int64_t i = 0; i < num_rows; i++) {
        float *x = logits + rows[i] * vocab;
        const int32_t *row_bits = bitmask + i * words;
        for (int64_t w = 0; w < words && w * 32 < vocab; w++) {
            const uint32_t bits = (uint32_t)row_bits[w];
            if (bits == 0xFFFFFFFFu) continue;
            const int64_t end = w * 32 + 32 < vocab ? w * 32 + 32 : vocab;
            for (int64_t t = w * 32; t < end; t++)
                if (!((bits >> (t - w * 32)) & 1u)) x[t] = -INFINITY;
        }
    }
}

/* tokens[r] = the first argmax of each row of logits [rows, vocab] (contiguous), as torch's. */
void argmax_rows(const float *logits, int64_t rows, int64_t vocab, int64_t *tokens,
                 int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if(rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * vocab;
        tokens[r] = first_max(x, vocab, row_max(x, vocab));
    }
}
