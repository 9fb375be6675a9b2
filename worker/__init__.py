"""kvstrata.worker: the engine of one worker (model, paged KV cache, scheduler, sampling)."""
