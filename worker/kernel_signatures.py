"""The C kernels' entry points as ctypes sees them: each one's argument and result types, declared
once when the shared object loads (CpuKernels), so that every call converts its Python ints,
floats and pointers the way the C side reads them.
"""

from __future__ import annotations

import ctypes


def declare(lib: ctypes.CDLL) -> None:
    """Sets argtypes and restype on every kvs_* function the Python side calls."""
    args = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6 + [ctypes.c_float]
    for fn in (lib.kvs_paged_decode_f32, lib.kvs_paged_decode_bf16, lib.kvs_paged_decode_bf16_rows):
        fn.argtypes = args
        fn.restype = None
    lib.kvs_paged_decode_codes.argtypes = args + [ctypes.c_void_p]
    lib.kvs_paged_decode_codes.restype = None
    lib.kvs_paged_decode_int4.argtypes = args + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.kvs_paged_decode_int4.restype = None
    for fn in (lib.kvs_gemm_f32, lib.kvs_gemm_bf16):
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        fn.restype = None
    lib.kvs_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3
    lib.kvs_pack.restype = None
    lib.kvs_packed_elems.argtypes = [ctypes.c_int64] * 3
    lib.kvs_packed_elems.restype = ctypes.c_int64
    lib.kvs_amx_enable.argtypes = []
    lib.kvs_amx_enable.restype = ctypes.c_int
    lib.kvs_amx_gemm.argtypes = ([ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int]
                                 + [ctypes.c_int64] * 3)
    lib.kvs_amx_gemm.restype = None
    lib.kvs_bf16_dot_enable.argtypes = [ctypes.c_int]
    lib.kvs_bf16_dot_enable.restype = ctypes.c_int
    lib.kvs_gemm_bf16x.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int]
                                   + [ctypes.c_int64] * 3)
    lib.kvs_gemm_bf16x.restype = None
    lib.kvs_gemm_group.argtypes = []
    lib.kvs_gemm_group.restype = ctypes.c_int64
    lib.kvs_gemm_set_prefetch_rows.argtypes = [ctypes.c_int64]
    lib.kvs_gemm_set_prefetch_rows.restype = None
    lib.kvs_gemm_set_turns.argtypes = [ctypes.c_int]  # float32 tiles in turns on/off (csrc/gemm.c's TURN_K)
    lib.kvs_gemm_set_turns.restype = None
    lib.kvs_gemm_set_row_panels.argtypes = [ctypes.c_int]  # tasks group by group within panels of rows, or not
    lib.kvs_gemm_set_row_panels.restype = None
    lib.kvs_gemm_set_two_groups.argtypes = [ctypes.c_int]  # one row, two groups at a time, where built
    lib.kvs_gemm_set_two_groups.restype = ctypes.c_int
    lib.kvs_gemm_set_lead_ahead.argtypes = [ctypes.c_int]  # small float32 blocks: the first tile prefetches
    lib.kvs_gemm_set_lead_ahead.restype = ctypes.c_int
    lib.kvs_gemm_set_short_first.argtypes = [ctypes.c_int]  # a short last block alone runs first
    lib.kvs_gemm_set_short_first.restype = ctypes.c_int
    lib.kvs_gemm_set_wide_copy.argtypes = [ctypes.c_int]  # widened bf16 through a float32 copy a group
    lib.kvs_gemm_set_wide_copy.restype = ctypes.c_int
    lib.kvs_gemm_set_wide_min_tiles.argtypes = [ctypes.c_int]  # the fewest row tiles a block copies for
    lib.kvs_gemm_set_wide_min_tiles.restype = ctypes.c_int
    lib.kvs_decode_set_key_ahead.argtypes = [ctypes.c_int]
    lib.kvs_decode_set_key_ahead.restype = ctypes.c_int
    # the key pass a head's tile at a time, its queries in registers (tests, benchmarks)
    lib.kvs_decode_set_key_tiles.argtypes = [ctypes.c_int]
    lib.kvs_decode_set_key_tiles.restype = ctypes.c_int
    # a block several sequences share is prefetched by the first of them only (tests, benchmarks)
    lib.kvs_decode_set_shared_owners.argtypes = [ctypes.c_int]
    lib.kvs_decode_set_shared_owners.restype = ctypes.c_int
    lib.kvs_decode_set_stream_bytes.argtypes = [ctypes.c_int64]  # how far ahead float32 decodes stream
    lib.kvs_decode_set_stream_bytes.restype = ctypes.c_int64
    lib.kvs_decode_stream_rows.argtypes = []  # rows float32 decodes streamed since the last call (tests)
    lib.kvs_decode_stream_rows.restype = ctypes.c_int64
    lib.kvs_prefill_set_pairs.argtypes = [ctypes.c_int]  # prefill attention tiles in pairs on/off
    lib.kvs_prefill_set_pairs.restype = ctypes.c_int
    lib.kvs_prefill_pair_tiles.argtypes = []
    lib.kvs_prefill_pair_tiles.restype = ctypes.c_int64
    lib.kvs_rms_norm_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    lib.kvs_add_rms_norm_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    lib.kvs_rms_norm_f32.restype = lib.kvs_add_rms_norm_f32.restype = None
    lib.kvs_rms_norm_bf16.argtypes = lib.kvs_rms_norm_f32.argtypes
    lib.kvs_add_rms_norm_bf16.argtypes = lib.kvs_add_rms_norm_f32.argtypes
    lib.kvs_rms_norm_bf16.restype = lib.kvs_add_rms_norm_bf16.restype = None
    for fn in (lib.kvs_rope_write_kv_f32, lib.kvs_rope_write_kv_bf16):
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 5
        fn.restype = None
    for fn in (lib.kvs_silu_mul_f32, lib.kvs_silu_mul_bf16):
        fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
        fn.restype = None
    # an MLP's gate_up product with its SiLU in one pass (csrc/gemm.c): x, the packed weight, a
    # scratch [M, 2I] for the cases it runs as two, act; M, I, K
    lib.kvs_gemm_f32_silu.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    lib.kvs_gemm_f32_silu.restype = None
    lib.kvs_gemm_bf16x_silu.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
                                        + [ctypes.c_int64] * 3)  # bf16 x (row stride), weight, scratch, act
    lib.kvs_gemm_bf16x_silu.restype = None
    lib.kvs_gemm_set_fused_silu.argtypes = [ctypes.c_int]  # tests and benchmarks: the two passes instead
    lib.kvs_gemm_set_fused_silu.restype = ctypes.c_int
    # a step's layers in one call (csrc/layer.c, driven by fused_decode.py): the LayerWeights array
    # and its length, the DecodeStep, layer 0's K cache, the bytes from one layer's cache to the
    # next and from K to V, bf16 or not, and where to write the layer that failed
    lib.kvs_layers.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
                               + [ctypes.c_int64] * 2 + [ctypes.c_int, ctypes.c_void_p])
    lib.kvs_layers.restype = ctypes.c_int
    lib.kvs_layers_time_stages.argtypes = [ctypes.c_void_p]
    lib.kvs_layers_time_stages.restype = None
    lib.kvs_layers_num_stages.restype = ctypes.c_int
    lib.kvs_paged_prefill_takes.argtypes = [ctypes.c_int64] * 4
    lib.kvs_paged_prefill_takes.restype = ctypes.c_int
    lib.kvs_paged_prefill_f32.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
                                          + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
                                          + [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_float])
    lib.kvs_paged_prefill_f32.restype = ctypes.c_int
    lib.kvs_paged_prefill_bf16.argtypes = lib.kvs_paged_prefill_f32.argtypes
    lib.kvs_paged_prefill_bf16.restype = ctypes.c_int
    lib.kvs_paged_prefill_quantized.argtypes = lib.kvs_paged_prefill_f32.argtypes + [ctypes.c_void_p,
                                                                                       ctypes.c_int64,
                                                                                       ctypes.c_int64]
    lib.kvs_paged_prefill_quantized.restype = ctypes.c_int
    lib.kvs_copy_blocks.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 8
    lib.kvs_copy_blocks.restype = None
    lib.kvs_crc32.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int64]
    lib.kvs_copy_crc32.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.kvs_crc32.restype = lib.kvs_copy_crc32.restype = ctypes.c_uint32
    lib.kvs_stage_slot.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_char_p] + [ctypes.c_int64] * 2 + [
        ctypes.c_void_p, ctypes.c_int64]
    lib.kvs_stage_slot.restype = ctypes.c_uint32
    lib.kvs_argmax_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.kvs_argmax_f32.restype = ctypes.c_int64
    lib.kvs_sample_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 7
    lib.kvs_sample_f32.restype = ctypes.c_int64
    lib.kvs_sample_scratch_bytes.argtypes = [ctypes.c_int64]
    lib.kvs_sample_scratch_bytes.restype = ctypes.c_int64
    rows = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]  # x, its stride, slots, tokens
    lib.kvs_int4_write_keys.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + rows + [ctypes.c_void_p,
                                                                                           ctypes.c_int]
    lib.kvs_int4_write_keys.restype = ctypes.c_int
    lib.kvs_int4_write_values.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + rows + [ctypes.c_void_p]
    lib.kvs_codes_write.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 2 + rows + [ctypes.c_int, ctypes.c_float]
    lib.kvs_int4_write_values.restype = lib.kvs_codes_write.restype = None
    lib.kvs_io_pool_new.argtypes = [ctypes.c_int, ctypes.c_int64]  # the NVMe tier's IO threads (csrc/io_pool.c)
    lib.kvs_io_pool_new.restype = ctypes.c_void_p
    for f in (lib.kvs_io_pool_short_slice_threads, lib.kvs_io_pool_close, lib.kvs_io_pool_free):
        f.argtypes = [ctypes.c_void_p]
    lib.kvs_io_pool_short_slice_threads.restype = ctypes.c_int
    lib.kvs_io_pool_close.restype = lib.kvs_io_pool_free.restype = None
    lib.kvs_io_submit.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                  ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_int64, ctypes.c_int64]
    lib.kvs_io_submit.restype = ctypes.c_int
    lib.kvs_io_reap.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_double]
    lib.kvs_io_reap.restype = ctypes.c_int
    lib.kvs_io_pool_busy_seconds.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.kvs_io_pool_busy_seconds.restype = ctypes.c_double
    lib.kvs_crc32_fast.argtypes = []
    lib.kvs_crc32_fast.restype = ctypes.c_int
