"""The paged KV cache: pages (`pool`), page policies (`allocator`), tensors (`paged_cache`)."""
