"""A torch-owned paged latent KV cache in MAX's MLA layout.

Storage
-------
``blocks [num_blocks, 1, num_layers, page_size, 1, head_dim]`` holds one
latent row (``kv_lora_rank`` latent values then ``qk_rope_head_dim`` rope
values, 576 for DeepSeek-V3) per token, per layer. Request ``b``'s token at
position ``p`` of layer ``l`` lives in
``blocks[lookup_table[b, p // page_size], 0, l, p % page_size, 0, :]``.

``cache_lengths[b]`` counts the tokens of request ``b`` that earlier steps
completed. A decode step first writes its new tokens' rows at positions
``cache_lengths[b] ..`` (:meth:`PagedLatentCache.append`, once per layer),
runs the op on every layer, then calls :meth:`PagedLatentCache.advance`.

The batch of an op call is the cache's requests in order: request ``b`` is
row ``b`` of ``lookup_table`` and of ``cache_lengths``.
"""

from __future__ import annotations

import torch

UNUSED_PAGE = 0xFFFFFFFF  # lookup-table entry of a page a request does not own


class PagedLatentCache:
    """Paged latent cache whose tensors torch owns and the op updates in place.

    Args:
        num_blocks: pages in the pool.
        page_size: tokens per page (any positive size).
        num_layers: layers stored per page.
        dtype: element type (bfloat16, float16 or float32, like the op's q).
        kv_lora_rank: latent width of a row (512 for DeepSeek-V3).
        qk_rope_head_dim: rope width of a row (64 for DeepSeek-V3).
        device: where the tensors live.
        shuffle_pages: hand out pages in a random order (as a long-running
            server would have them), from ``generator``.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        page_size: int,
        num_layers: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        kv_lora_rank: int = 512,
        qk_rope_head_dim: int = 64,
        device: torch.device | str = "cpu",
        shuffle_pages: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        for name, value in (
            ("num_blocks", num_blocks),
            ("page_size", page_size),
            ("num_layers", num_layers),
        ):
            if int(value) < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.page_size = int(page_size)
        self.num_layers = int(num_layers)
        self.kv_lora_rank = int(kv_lora_rank)
        self.qk_rope_head_dim = int(qk_rope_head_dim)
        self.head_dim = self.kv_lora_rank + self.qk_rope_head_dim
        self.device = torch.device(device)
        self.blocks = torch.zeros(
            num_blocks, 1, num_layers, page_size, 1, self.head_dim, dtype=dtype, device=self.device
        )
        order = (
            torch.randperm(num_blocks, generator=generator).tolist()
            if shuffle_pages
            else list(range(num_blocks))
        )
        self._free_pages = order[::-1]  # pop() hands out order[0] first
        self._pages: list[list[int]] = []
        self._lengths: list[int] = []
        self._pending: list[int] = []
        self.cache_lengths = torch.zeros(0, dtype=torch.uint32, device=self.device)
        self.lookup_table = torch.zeros(0, 1, dtype=torch.uint32, device=self.device)

    # ------------------------------------------------------------------ requests
    @property
    def num_requests(self) -> int:
        return len(self._lengths)

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks.dtype

    def add_request(self) -> int:
        """Adds an empty request at the end of the batch; returns its index."""
        self._pages.append([])
        self._lengths.append(0)
        self._pending.append(0)
        self._sync_tables()
        return self.num_requests - 1

    def length(self, request: int) -> int:
        """Tokens of ``request`` completed by earlier steps (its cache length)."""
        return self._lengths[request]

    def pending(self, request: int) -> int:
        """New tokens written for ``request`` by :meth:`append` but not yet advanced."""
        return self._pending[request]

    def _reserve(self, request: int, total_tokens: int) -> None:
        pages = self._pages[request]
        needed = -(-total_tokens // self.page_size)
        while len(pages) < needed:
            if not self._free_pages:
                raise RuntimeError(
                    f"PagedLatentCache: out of pages ({self.blocks.shape[0]} blocks of {self.page_size} tokens)"
                )
            pages.append(self._free_pages.pop())

    def append(self, request: int, layer: int, rows: torch.Tensor) -> None:
        """Writes the new tokens' latent rows of one layer after the request's cached tokens.

        ``rows [n, head_dim]`` land at positions ``length(request) .. + n - 1``.
        Every layer of a step must append the same number of rows; the op then
        rotates and normalizes them in place. Call :meth:`advance` when the
        step is done.
        """
        if rows.dim() != 2 or rows.shape[1] != self.head_dim:
            raise ValueError(f"rows: expected shape [n, {self.head_dim}], got {tuple(rows.shape)}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.num_layers}, got {layer}")
        n = rows.shape[0]
        if self._pending[request] not in (0, n):
            raise ValueError(
                f"rows: request {request} already has {self._pending[request]} pending tokens "
                f"in another layer, got {n}"
            )
        self._pending[request] = n
        start = self._lengths[request]
        self._reserve(request, start + n)
        self._sync_tables()
        self.write(request, layer, start, rows)

    def reserve(self, request: int, n: int) -> None:
        """Makes room for ``n`` new tokens of ``request`` without writing their rows.

        For steps whose rows reach the op as ``new_rows`` (the op writes them
        into these slots); they count as pending until :meth:`advance`.
        """
        if self._pending[request] not in (0, n):
            raise ValueError(
                f"n: request {request} already has {self._pending[request]} pending tokens, got {n}"
            )
        self._pending[request] = n
        self._reserve(request, self._lengths[request] + n)
        self._sync_tables()

    def write(self, request: int, layer: int, start: int, rows: torch.Tensor) -> None:
        """Writes ``rows`` at positions ``start ..`` of pages the request already owns."""
        pages = self._pages[request]
        pos = torch.arange(start, start + rows.shape[0])
        if rows.shape[0] and int(pos[-1]) // self.page_size >= len(pages):
            raise ValueError(
                f"rows: positions up to {int(pos[-1])} exceed the pages of request {request}"
            )
        page_ids = torch.tensor(pages, dtype=torch.long)[pos // self.page_size]
        self.blocks[
            page_ids.to(self.device), 0, layer, (pos % self.page_size).to(self.device), 0, :
        ] = rows.to(self.blocks.dtype).to(self.device)

    def rows(
        self, request: int, layer: int, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """A copy of the request's rows at positions ``start .. stop - 1`` (default: all written)."""
        stop = self._lengths[request] + self._pending[request] if stop is None else stop
        pos = torch.arange(start, stop)
        page_ids = torch.tensor(self._pages[request], dtype=torch.long)[pos // self.page_size]
        return self.blocks[
            page_ids.to(self.device), 0, layer, (pos % self.page_size).to(self.device), 0, :
        ]

    def advance(self) -> None:
        """Ends a step: every request's pending tokens join its cached tokens."""
        for b, n in enumerate(self._pending):
            self._lengths[b] += n
            self._pending[b] = 0
        self._sync_tables()

    def fill(self, request: int, num_tokens: int, generator: torch.Generator | None = None) -> None:
        """Gives ``request`` ``num_tokens`` completed tokens of random rows in every layer."""
        start = self._lengths[request] + self._pending[request]
        self._reserve(request, start + num_tokens)
        self._sync_tables()
        for layer in range(self.num_layers):
            rows = torch.randn(num_tokens, self.head_dim, generator=generator)
            self.write(request, layer, start, rows)
        self._lengths[request] += num_tokens
        self._sync_tables()

    # ------------------------------------------------------------------ tensors
    def _sync_tables(self) -> None:
        width = max([1] + [len(p) for p in self._pages])
        table = torch.full((self.num_requests, width), UNUSED_PAGE, dtype=torch.int64)
        for b, pages in enumerate(self._pages):
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
        self.lookup_table = table.to(torch.uint32).to(self.device)
        self.cache_lengths = (
            torch.tensor(self._lengths, dtype=torch.int64).to(torch.uint32).to(self.device)
        )

    def to(self, device: str | torch.device) -> None:
        """Moves the cache's tensors to ``device``."""
        self.device = torch.device(device)
        self.blocks = self.blocks.to(self.device)
        self._sync_tables()

    def pages_of(self, request: int) -> list[int]:
        """The block indices request ``request`` owns, in position order."""
        return list(self._pages[request])
