/* Greedy sampling's argmax over float32 rows (logits [rows, vocab]): the index of each row's largest
 * value, the first of equal ones, as torch.argmax gives it. torch took 1.37 ms for 32 rows of a
 * 49,152-token vocabulary on a 2-core host (about 2% of a batch-32 decode step); one vector pass a
 * row, rows shared between the threads, is about a tenth of that.
 *
 * Each lane keeps its largest value and where it first saw it (a strict > keeps the first of
 * equal values); the lanes are then reduced to the largest value at the smallest index, and the
 * tail past the last whole vector is scanned in order. A NaN compares false, so a row holding one
 * is reported instead (torch treats NaN as the largest value) and the caller asks torch.
 */
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* out[r] = argmax of row r; returns the number of rows that hold a NaN (their out is not set). */
int64_t kvs_argmax_f32(const float *x, int64_t rows, int64_t n, int64_t *out) {
    int64_t nan_rows = 0;
#pragma omp parallel for schedule(static) reduction(+ : nan_rows) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *p = x + r * n;
        float best;
        int64_t at = 0, j = 0;
        int nan = 0;
        if (n >= VW) {
            vf vmax = loadv(p);
            vi vat = lane_ids, bad = (vi)(vmax != vmax);
            for (j = VW; j + VW <= n; j += VW) {
                vf v = loadv(p + j);
                vi more = (vi)(v > vmax);
                vmax = selectv(more, v, vmax);
                vat = (more & (lane_ids + (int32_t)j)) | (~more & vat);
                bad |= (vi)(v != v);
            }
            float lane_max[VW];
            int32_t lane_at[VW], lane_bad[VW];
            memcpy(lane_max, &vmax, sizeof lane_max);
            memcpy(lane_at, &vat, sizeof lane_at);
            memcpy(lane_bad, &bad, sizeof lane_bad);
            best = lane_max[0];
            at = lane_at[0];
            for (int i = 0; i < VW; i++) {
                nan |= lane_bad[i];
                if (lane_max[i] > best || (lane_max[i] == best && lane_at[i] < at)) {
                    best = lane_max[i];
                    at = lane_at[i];
                }
            }
        } else {
            best = p[0];
            nan = best != best;
            j = 1;
        }
        for (; j < n; j++) { /* the tail: later indices, so only a larger value wins */
            nan |= p[j] != p[j];
            if (p[j] > best) {
                best = p[j];
                at = j;
            }
        }
        if (nan)
            nan_rows++;
        else
            out[r] = at;
    }
    return nan_rows;
}
