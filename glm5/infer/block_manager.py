"""Paged KV blocks: allocation, reference counts and prefix caching. Plain Python, no tensors.

A block holds `block_size` tokens' KV. A full block whose KV has been computed is registered under a
chained hash of (parent block hash, its token ids[, cache salt for the first block]), so a later
request with the same prefix reuses it (vLLM / nano-vllm prefix caching). A hash hit is confirmed by
comparing token ids and parent hash, so a hash collision can never serve the wrong KV. Free blocks
sit in an LRU queue (OrderedDict, least recently freed first); a cached block stays reusable until
it is evicted from the head of that queue. The runner owns the tensors and only reads block tables.

Partial blocks (`cache_partial_blocks`): when a request frees its blocks, a last block holding k < block_size
computed tokens is registered too, under the hash of (parent block hash, its first j token ids) for each
j <= k. A later request
whose tokens continue that prefix takes the full blocks as usual and, for the next block, a fresh block
into which the runner first copies those k rows (`take_copies`: copy-on-write, as vLLM's v0 block manager
did for beam search), so only the tokens after them are computed. That is what makes beam search cheap
(each step's requests extend the previous step's by one token, mostly inside a partial block) and helps
any two prompts sharing a prefix that does not end on a block boundary (SGLang's radix cache reuses
prefixes token by token).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from glm5.infer.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent_hash: bytes | None, token_ids, extra_key: str | None = None) -> bytes:
    """Chained block hash: blake2b over (parent hash, int64 token ids, extra key). Stable across runs."""
    h = hashlib.blake2b(parent_hash or b"\0", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        h.update(b"\1" + extra_key.encode())
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full, computed and registered
    parent_hash: bytes | None = None  # for the collision check
    token_ids: tuple[int, ...] = ()  # for the collision check
    partial_keys: tuple[bytes, ...] = ()  # registered as a partial block: a key per prefix of its rows


@dataclass
class ComputedBlocks:
    """A prefix-cache hit: cached block ids covering the first `num_tokens` tokens of a request."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens whose KV is reused (the partial block's included)
    partial: tuple[int, int] | None = None  # (block id, rows): a partial block's first rows, copied first


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 cache_partial_blocks: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_partial_blocks = enable_prefix_caching and cache_partial_blocks
        self.partial_to_block_id: dict[bytes, int] = {}
        self._copies: list[tuple[int, int, int]] = []  # (source block, destination block, rows) to copy
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head = evict first
        self.hash_to_block_id: dict[bytes, int] = {}
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already hashed/registered
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of which served from the cache
        self.partial_block_hits = 0  # admissions that reused a partial block (its rows copied)

    @staticmethod
    def num_blocks_for_memory(memory_bytes: int, bytes_per_block: int) -> int:
        """How many blocks fit a KV budget; `bytes_per_block` comes from the runner (all layers' K/V)."""
        if bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block must be > 0, got {bytes_per_block}")
        return int(memory_bytes) // int(bytes_per_block)

    @classmethod
    def from_memory(cls, memory_bytes: int, bytes_per_block: int, block_size: int = 16, **kwargs):
        return cls(cls.num_blocks_for_memory(memory_bytes, bytes_per_block), block_size, **kwargs)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---- prefix cache -------------------------------------------------------------------------

    def compute_block_hashes(self, req: Request) -> list[bytes]:
        """Extend `req.block_hashes` to cover every full block of its tokens."""
        bs = self.block_size
        for i in range(len(req.block_hashes), req.num_tokens // bs):
            parent = req.block_hashes[i - 1] if i else None
            salt = req.cache_salt if i == 0 else None
            req.block_hashes.append(hash_block(parent, req.all_token_ids[i * bs:(i + 1) * bs], salt))
        return req.block_hashes

    def get_computed_blocks(self, req: Request) -> ComputedBlocks:
        """The longest cached prefix of `req` in full blocks; at least one token is left to compute (its
        logits are needed). Touches nothing: pass the result to `allocate_slots` to take the blocks.
        Requests that ask for prompt logprobs skip the cache (they need logits for every prompt token)."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return ComputedBlocks()
        bs = self.block_size
        hashes = self.compute_block_hashes(req)
        hit: list[int] = []
        for i in range((req.num_tokens - 1) // bs):
            block_id = self.hash_to_block_id.get(hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            parent = hashes[i - 1] if i else None
            if block.parent_hash != parent or block.token_ids != tuple(req.all_token_ids[i * bs:(i + 1) * bs]):
                break  # a hash collision: not the same tokens
            hit.append(block_id)
        computed = ComputedBlocks(hit, len(hit) * bs)
        if self.cache_partial_blocks:
            computed.partial = self._partial_hit(req, len(hit), hashes[len(hit) - 1] if hit else None)
            if computed.partial is not None:
                computed.num_tokens += computed.partial[1]
        return computed

    def _partial_hit(self, req: Request, i: int, parent: bytes | None) -> tuple[int, int] | None:
        """The longest registered partial block continuing `req`'s first i full blocks, leaving at least one
        token to compute: (block id, rows) or None."""
        bs, toks = self.block_size, req.all_token_ids
        salt = req.cache_salt if i == 0 else None
        for k in range(min(bs - 1, req.num_tokens - 1 - i * bs), 0, -1):
            chunk = toks[i * bs:i * bs + k]
            block_id = self.partial_to_block_id.get(hash_block(parent, chunk, salt))
            if block_id is not None:
                block = self.blocks[block_id]
                if block.parent_hash == parent and block.token_ids[:k] == tuple(chunk):
                    return block_id, k
        return None

    # ---- allocation -----------------------------------------------------------------------------

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: ComputedBlocks | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Give `req` slots for `num_new_tokens` more tokens (+ lookahead slots for draft tokens).

        `computed` is `get_computed_blocks(req)` for a request being admitted (None for a running one):
        those blocks are taken first (ref count + 1, out of the free queue) and the lookup is counted
        in the prefix-cache stats. Returns the newly allocated block ids (possibly
        []), or None when there are not enough free blocks; then nothing has changed and the scheduler
        must preempt or wait."""
        is_admission = computed is not None
        computed = computed or ComputedBlocks()
        bs = self.block_size
        num_total = req.num_computed_tokens + computed.num_tokens + num_new_tokens + num_lookahead_tokens
        num_held = len(req.block_ids) + len(computed.block_ids)
        num_needed = max(cdiv(num_total, bs) - num_held, 0)
        # taking a free cached block removes it from the free queue, so it is not also free capacity
        taken = computed.block_ids + ([computed.partial[0]] if computed.partial else [])
        num_hit_free = sum(1 for b in taken if self.blocks[b].ref_cnt == 0)
        if num_needed > self.num_free_blocks - num_hit_free:
            return None
        if is_admission:  # first admission or re-admission after preemption
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += computed.num_tokens
        for b in taken:  # (the partial source is held until its rows are copied: `release_copies`)
            self._take(self.blocks[b])
        new_ids = [self._pop_free() for _ in range(num_needed)]
        if computed.partial:  # the first new block continues the prefix: its first rows are the source's
            self._copies.append((computed.partial[0], new_ids[0], computed.partial[1]))
            self.partial_block_hits += 1
        req.block_ids.extend(computed.block_ids)
        req.block_ids.extend(new_ids)
        if computed.block_ids:
            self._num_registered[req.request_id] = len(computed.block_ids)
        return new_ids

    def cache_blocks(self, req: Request) -> None:
        """Register the full blocks whose KV is now computed (called after the step that computed them),
        so later requests can reuse them. A block whose hash is already registered (two requests
        computed the same prefix at once) stays unregistered and is freed like any other."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(req.num_computed_tokens, req.num_tokens) // bs
        start = self._num_registered.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self.compute_block_hashes(req)
        for i in range(start, num_full):
            block = self.blocks[req.block_ids[i]]
            if block.block_hash is None and hashes[i] not in self.hash_to_block_id:
                block.block_hash, block.parent_hash = hashes[i], (hashes[i - 1] if i else None)
                block.token_ids = tuple(req.all_token_ids[i * bs:(i + 1) * bs])
                self.hash_to_block_id[hashes[i]] = block.block_id
        self._num_registered[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Drop `req`'s hold on its blocks. Blocks are queued tail-first, so a prefix outlives its
        tail under LRU; unregistered blocks go to the head (they hold nothing reusable). With
        `cache_partial_blocks`, a last block of computed rows short of full is registered first."""
        if self.cache_partial_blocks:
            self._register_partial(req)
        for block_id in reversed(req.block_ids):
            self._drop(self.blocks[block_id])
        req.block_ids = []
        self._num_registered.pop(req.request_id, None)

    def _drop(self, block: Block) -> None:
        block.ref_cnt -= 1
        assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
        if block.ref_cnt == 0:
            self.free_queue[block.block_id] = None
            if block.block_hash is None and not block.partial_keys:
                self.free_queue.move_to_end(block.block_id, last=False)

    def _register_partial(self, req: Request) -> None:
        bs = self.block_size
        n = min(req.num_computed_tokens, req.num_tokens)
        i, k = divmod(n, bs)
        if k == 0 or i >= len(req.block_ids) or req.params.prompt_logprobs is not None:
            return
        block = self.blocks[req.block_ids[i]]
        if block.ref_cnt != 1 or block.block_hash is not None or block.partial_keys:
            return  # shared or already registered: its rows may be written by someone else
        hashes = self.compute_block_hashes(req)
        parent = hashes[i - 1] if i else None
        chunk = req.all_token_ids[i * bs:i * bs + k]
        salt = req.cache_salt if i == 0 else None
        keys = [key for key in (hash_block(parent, chunk[:j], salt) for j in range(1, k + 1))
                if key not in self.partial_to_block_id]  # (a prefix another block holds stays with it)
        if not keys:
            return
        block.partial_keys, block.parent_hash, block.token_ids = tuple(keys), parent, tuple(chunk)
        for key in keys:
            self.partial_to_block_id[key] = block.block_id

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The (source block, destination block, rows) copies admissions asked for since the last call: the
        runner copies them before the step that reads them, then `release_copies` lets the sources go."""
        copies, self._copies = self._copies, []
        return copies

    def release_copies(self, copies: list[tuple[int, int, int]]) -> None:
        for src, _, _ in copies:
            self._drop(self.blocks[src])

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after the weights changed: old KV must not be reused)."""
        for block in self.blocks:
            block.block_hash, block.parent_hash, block.token_ids, block.partial_keys = None, None, (), ()
        self.hash_to_block_id.clear()
        self.partial_to_block_id.clear()
        self._num_registered.clear()  # no block is registered any more: running requests may register again

    def _take(self, block: Block) -> None:
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict it from the prefix cache
            if self.hash_to_block_id.get(block.block_hash) == block_id:
                del self.hash_to_block_id[block.block_hash]
            block.block_hash, block.parent_hash, block.token_ids = None, None, ()
        for key in block.partial_keys:
            if self.partial_to_block_id.get(key) == block_id:
                del self.partial_to_block_id[key]
        if block.partial_keys:
            block.partial_keys, block.parent_hash, block.token_ids = (), None, ()
        block.ref_cnt = 1
        return block_id
