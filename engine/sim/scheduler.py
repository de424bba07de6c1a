"""The sim engine's scheduler: vLLM V1's policy in plain Python, no clock and no I/O.

Each step (`schedule`, then `complete`):
  1. running requests first, in arrival order: one token for a decoding request, the next chunk
     for one still in its prompt, within the step's token budget (chunked prefill). A request
     that needs a block when none is free preempts the newest running request (its blocks are
     freed and it is recomputed later; its output so far is kept);
  2. then waiting requests in order, while the budget, `max_num_seqs` and free blocks allow; a
     new request first takes its prompt's cached prefix blocks. A request whose KV comes from a
     producer (`kv_transfer_s`) first holds blocks for its prompt while the transfer runs,
     then computes only the last prompt position, as vLLM's KV connectors do;
  3. an engine with nothing running whose first waiting request cannot get blocks, because
     requests behind it hold them (KV loaded, or still arriving) and no transfer is in flight
     to wake it, would wait forever: the newest of those gives its blocks back (recomputed
     later, or its KV pulled again) until the first fits.
`complete` advances the computed tokens; a request whose tokens are all computed samples one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.sim.blocks import BlockPool, block_hashes
from engine.sim.tokens import TokenSource


@dataclass(eq=False)  # one request is one object: `in` and `remove` by identity
class SimRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    token_seed: int
    # KV loaded from a producer: seconds the transfer takes; None: computed here.
    kv_transfer_s: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0
    kv_ready_at: float | None = None
    is_kv_loaded: bool = False
    num_preemptions: int = 0
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + tuple(self.output_token_ids)


@dataclass(frozen=True)
class ScheduledChunk:
    request: SimRequest
    num_context: int  # tokens computed before this chunk
    num_tokens: int

    @property
    def is_decode(self) -> bool:
        return self.num_context >= len(self.request.prompt_token_ids)


@dataclass(frozen=True)
class Step:
    chunks: tuple[ScheduledChunk, ...]
    num_preempted: int = 0

    @property
    def prefill_chunks(self) -> list[tuple[int, int]]:
        return [(c.num_context, c.num_tokens) for c in self.chunks if not c.is_decode]

    @property
    def decode_contexts(self) -> list[int]:
        return [c.num_context + 1 for c in self.chunks if c.is_decode]


@dataclass(frozen=True)
class Sampled:
    """A token a step produced; `finish_reason` set on the request's last."""

    request: SimRequest
    token_id: int
    finish_reason: str | None


class SimScheduler:
    def __init__(
        self,
        blocks: BlockPool,
        tokens: TokenSource,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        self.blocks = blocks
        self.tokens = tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: SimRequest) -> None:
        if len(request.prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(request.prompt_token_ids)} tokens; "
                f"the model's context is {self.max_model_len}"
            )
        most = min(len(request.prompt_token_ids) + request.max_tokens, self.max_model_len)
        if self.blocks.blocks_for(most) > self.blocks.num_blocks:
            # Alone in the engine it could never hold its blocks: refused, not left to wait.
            raise ValueError(
                f"a request of up to {most} tokens needs more KV than this engine has "
                f"({self.blocks.num_blocks * self.blocks.block_size} tokens)"
            )
        self.waiting.append(request)

    def abort(self, request_id: str) -> SimRequest | None:
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._release(request)
                    return request
        return None

    def next_kv_ready_at(self) -> float | None:
        """When the earliest transfer in flight lands (the engine sleeps until then)."""
        times = [r.kv_ready_at for r in self.waiting if r.kv_ready_at is not None]
        return min(times) if times else None

    def schedule(self, now: float) -> Step:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        num_preempted = 0
        scheduled: set[str] = set()
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted by a request ahead of it
                continue
            num_new = min(request.num_tokens - request.num_computed, budget)
            need = self.blocks.blocks_for(request.num_computed + num_new) - len(request.blocks)
            while not self.blocks.can_allocate(need):
                victim = self.running[-1]
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
            if request not in self.running:
                continue
            request.blocks += self.blocks.allocate(need)
            chunks.append(ScheduledChunk(request, request.num_computed, num_new))
            scheduled.add(request.request_id)
            budget -= num_new
        skipped: list[SimRequest] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            if not self._kv_ready(request, now):
                skipped.append(request)
                continue
            if not request.blocks:
                self._take_cached_prefix(request)
            num_new = min(request.num_tokens - request.num_computed, budget)
            need = self.blocks.blocks_for(request.num_computed + num_new) - len(request.blocks)
            if not self.blocks.can_allocate(need):
                self.waiting.appendleft(request)
                break
            request.blocks += self.blocks.allocate(need)
            self.running.append(request)
            chunks.append(ScheduledChunk(request, request.num_computed, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        if not chunks and not self.running and self._unblock(now):
            return self.schedule(now)
        return Step(tuple(chunks), num_preempted)

    def _unblock(self, now: float) -> bool:
        """Nothing runs and nothing was scheduled: unless a transfer in flight will wake the
        engine, the newest waiting request holding blocks gives them back (True), so the
        first waiting request can have them."""
        if any(r.kv_ready_at is not None and now < r.kv_ready_at for r in self.waiting):
            return False
        holders = [r for r in list(self.waiting)[1:] if r.blocks]
        if not holders:
            return False
        victim = holders[-1]
        self._release(victim)
        victim.num_computed = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        if not victim.is_kv_loaded:
            victim.kv_ready_at = None  # its transfer starts again when it gets blocks
        return True

    def complete(self, step: Step) -> list[Sampled]:
        """Apply a step that has run: computed tokens advance, finished prompts sample."""
        sampled: list[Sampled] = []
        for chunk in step.chunks:
            request = chunk.request
            if request not in self.running:  # aborted while the step ran
                continue
            request.num_computed += chunk.num_tokens
            if request.num_computed < request.num_tokens:
                continue  # a prompt chunk short of the end samples nothing
            self._cache_full_blocks(request)
            token = self.tokens.token(request.token_seed, len(request.output_token_ids))
            request.output_token_ids.append(token)
            if (
                len(request.output_token_ids) >= request.max_tokens
                or request.num_tokens >= self.max_model_len
            ):
                request.finish_reason = "length"
                self.running.remove(request)
                self._release(request)
            sampled.append(Sampled(request, token, request.finish_reason))
        return sampled

    def _kv_ready(self, request: SimRequest, now: float) -> bool:
        """A consumer request holds blocks for its prompt while its KV is in flight."""
        if request.kv_transfer_s is None or request.is_kv_loaded:
            return True
        if request.kv_ready_at is None:
            need = self.blocks.blocks_for(len(request.prompt_token_ids))
            if not self.blocks.can_allocate(need):
                return False
            request.blocks = self.blocks.allocate(need)
            request.kv_ready_at = now + request.kv_transfer_s
        if now < request.kv_ready_at:
            return False
        request.is_kv_loaded = True
        request.num_computed = request.num_cached_tokens = len(request.prompt_token_ids) - 1
        return True

    def _take_cached_prefix(self, request: SimRequest) -> None:
        # The last prompt token is always computed (its logits give the next token).
        hashes = block_hashes(
            request.all_token_ids[: request.num_tokens - 1], self.blocks.block_size
        )
        hits = self.blocks.match_prefix(hashes)
        self.blocks.take(hits)
        request.blocks = list(hits)
        request.num_computed = len(hits) * self.blocks.block_size
        if not request.output_token_ids and not request.num_preemptions:
            request.num_cached_tokens = request.num_computed

    def _cache_full_blocks(self, request: SimRequest) -> None:
        hashes = block_hashes(request.all_token_ids[: request.num_computed], self.blocks.block_size)
        for block, block_hash in zip(request.blocks, hashes, strict=False):
            self.blocks.register(block, block_hash)

    def _preempt(self, request: SimRequest) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: SimRequest) -> None:
        self.blocks.free(request.blocks)
        request.blocks = []
