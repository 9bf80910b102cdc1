"""The engine's KV cache: allocation (request-sized, grown and shrunk by copying), the
capacity checks a request passes before any work, and slot moves (a draft tree's accepted
path). `KVCacheSlots` is a part of `Engine` (core.py) with this one job; it reads the
engine's view, config, devices and mixer cache, and tells its CUDA-graph executor when
the cache's addresses change."""

from __future__ import annotations

from collections.abc import Sequence

from .attention import KEY_BLOCK
from .config import SHRINK_RATIO
from .devices import GroupedCache
from .memory import zeroed

__all__ = ["KVCacheSlots", "whole_blocks"]


def whole_blocks(slots: int) -> int:
    """`slots` rounded up to whole key blocks."""
    return -(-slots // KEY_BLOCK) * KEY_BLOCK


class KVCacheSlots:
    """The KV cache of an `Engine`: k_cache, v_cache, capacity, num_slots, trash_slot."""

    def _allocate(self, capacity: int, keep: int = 0) -> None:
        """A KV cache of `capacity` usable slots (+ the trash slot pad rows write, rounded up
        to whole key blocks), with the first `keep` slots of the current cache copied in."""
        v = self.view
        num_slots = whole_blocks(capacity + 1)
        shape = (v.num_layers, v.num_kv_heads, num_slots, v.head_dim)
        old_k, old_v = self.k_cache, self.v_cache
        self.k_cache = self.v_cache = None  # the caller's references keep the old ones alive
        if self.several_devices:  # one tensor per run of layers, on its device
            k_cache = GroupedCache(self.groups, [zeroed((g.hi - g.lo, *shape[1:]), v.dtype, g.device)
                                                 for g in self.groups])
            v_cache = k_cache if v.values_are_keys else GroupedCache(
                self.groups, [zeroed((g.hi - g.lo, *shape[1:]), v.dtype, g.device) for g in self.groups])
            if keep and old_k is not None:
                k_cache.keep(old_k, keep)
                if v_cache is not k_cache:
                    v_cache.keep(old_v, keep)
        else:
            k_cache = zeroed(shape, v.dtype, v.device)
            # latent attention: the values are the keys' own tensor (LatentAttentionWeights)
            v_cache = k_cache if v.values_are_keys else zeroed(shape, v.dtype, v.device)
            if keep and old_k is not None:
                k_cache[:, :, :keep] = old_k[:, :, :keep]
                if v_cache is not k_cache:
                    v_cache[:, :, :keep] = old_v[:, :, :keep]
        del old_k, old_v
        self.k_cache, self.v_cache = k_cache, v_cache
        self.capacity = capacity
        self.num_slots = num_slots
        self.trash_slot = capacity
        # RoPE tables for the positions one sequence can reach: a batch's cache holds several
        # sequences' regions, more slots than any sequence has positions
        positions = min(capacity, getattr(v.config, "max_position_embeddings", None) or capacity)
        if v.max_positions != positions:
            v.set_max_positions(positions)
        if getattr(self, "graphs", None) is not None:
            self.graphs.reset()  # captured programs read the old cache's addresses

    @property
    def position_limit(self) -> int:
        """Positions a sequence may reach in this cache: its slots, at most the RoPE table's
        (a batch's cache has more slots than any one sequence has positions)."""
        return min(self.capacity, self.view.max_positions)

    def capacity_for(self, need: int) -> int:
        """The capacity a cache for `need` slots gets: whole key blocks (the trash slot
        included), at most the model's max_position_embeddings (never below `need`)."""
        limit = getattr(self.view.config, "max_position_embeddings", None)
        capacity = whole_blocks(need + 1) - 1
        return max(need, min(capacity, limit)) if limit else capacity

    def ensure_capacity(self, need: int, *, keep: int | None = None, release: bool = False) -> None:
        """Room for `need` KV slots: a shorter cache grows to `capacity_for(need)` by copying
        its first `keep` slots (default: all it has; 0 when no slot is in use yet) into a new
        one; nothing is measured again. With `release`, a cache more than SHRINK_RATIO times
        `capacity_for(need)` shrinks back to max(EngineConfig.capacity, that), so a one-off
        long request does not keep its memory."""
        if not isinstance(need, int) or need < 1:
            raise ValueError(f"need must be a positive int, got {need!r}")
        if keep is not None and (not isinstance(keep, int) or keep < 0):
            raise ValueError(f"keep must be None or an int >= 0, got {keep!r}")
        if keep == 0 and self.mixer_cache is not None:  # a new request: no sequence's state is kept
            self.mixer_cache.new_request()
        target = self.capacity
        wanted = self.capacity_for(need)
        if need > self.capacity:
            target = wanted
        elif release and self.capacity > SHRINK_RATIO * wanted and self.capacity > self.config.capacity:
            target = max(self.config.capacity, wanted)
        if target != self.capacity:
            kept = self.capacity if keep is None else keep
            self._allocate(target, keep=min(kept, self.capacity, target))

    def check_capacity(self, prompt_len: int, max_new_tokens: int, draft_rows: int | None = None) -> None:
        """prompt + max_new + `draft_rows` (default: the width) must fit the KV cache; raise
        before any work otherwise. The speculative loop passes draft_rows=0: it drafts fewer
        rows near the end of the cache, so it needs only the slots AR decoding needs."""
        if prompt_len < 1:
            raise ValueError("the prompt is empty: pass at least one input token")
        rows = self.width if draft_rows is None else draft_rows
        need = prompt_len + max_new_tokens + rows
        if need > self.capacity:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) + draft rows "
                f"({rows}) = {need} exceeds the engine's KV capacity ({self.capacity}). "
                "Shorten the prompt, lower max_new_tokens, or call engine.ensure_capacity(need)."
            )
        if need > self.position_limit:  # the RoPE table stops at the model's positions
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) + draft rows "
                f"({rows}) = {need} exceeds the positions this engine can rotate "
                f"({self.position_limit}: the model's max_position_embeddings). Shorten the prompt "
                "or lower max_new_tokens."
            )


    def move_kv(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copy every layer's K and V from slot sources[i] to targets[i], in order (a draft
        tree's accepted path, compacted to consecutive positions: targets never overwrite a
        later source when both increase and targets[i] <= sources[i])."""
        for src, dst in zip(sources, targets):
            if src != dst and self.several_devices:
                self.k_cache.copy_slot(src, dst)
                if self.v_cache is not self.k_cache:
                    self.v_cache.copy_slot(src, dst)
            elif src != dst:
                self.k_cache[:, :, dst] = self.k_cache[:, :, src]
                if self.v_cache is not self.k_cache:  # (latent attention: one tensor)
                    self.v_cache[:, :, dst] = self.v_cache[:, :, src]
        if self.mixer_cache is not None:
            self.mixer_cache.move(sources, targets)

