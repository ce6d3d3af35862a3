"""KV page allocator: free pages, reference counts and a prefix cache of full pages. No JAX.

A full page is keyed by `hash((previous page key, its token ids))`, a chain, so a key names the
whole prefix up to the end of that page. Cached pages whose refcount drops to 0 stay keyed and
evictable (least recently freed first); they count as free and are reused when no free page is
left. The first `reserved_pages` ids are never handed out (page 0: padding slots and padded page tables).

Placement keeps each sequence's pages consecutive where it can, because the CPU attention
kernel streams a row's pages from memory and scattered pages cost it bandwidth: random 16 KiB
pages read at about half the speed of one run (docs/benchmark-log.md, session 19). A sequence's
first pages open a *run*: the start of a stretch of available pages long enough for all the
tokens it may reach; the rest of the stretch is earmarked for it, and its later pages take the
next page of its run. Other sequences open runs only on pages nobody earmarked. Earmarks are
soft: they still count as free, and when nothing else is left any allocation takes them. They
are dropped when their sequence frees its pages. A run may also take cached pages that were
never hit again (their prefix was never reused); a page that served a lookup is evicted only
in least-recently-freed order, as before.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class OutOfPagesError(RuntimeError):
    """More pages were asked for than are free."""


def page_key(previous: int | None, tokens: tuple[int, ...]) -> int:
    """Prefix-cache key of a full page holding `tokens` after the page keyed `previous`."""
    return hash((previous, tokens))


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = True, reserved_pages: int = 1):
        if not 0 <= reserved_pages < num_pages:
            raise ValueError("need 0 <= reserved_pages < num_pages")
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.num_pages = num_pages  # total, reserved ones included
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.reserved_pages = reserved_pages
        self._is_free = np.zeros(num_pages, bool)  # [N] unkeyed, refcount 0
        self._is_free[reserved_pages:] = True
        self._num_free = num_pages - reserved_pages
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed, refcount 0, LRU first
        self._is_evictable = np.zeros(num_pages, bool)  # [N] the same set, for run searches
        self._is_reused = np.zeros(num_pages, bool)  # [N] cached pages a lookup has hit: evicted in LRU order only
        self._run = np.full(num_pages, -1, np.int64)  # [N] run id (its first page) of held or earmarked pages
        self._refcount = [0] * num_pages
        self._key_of: dict[int, int] = {}  # page -> key
        self._page_of: dict[int, int] = {}  # key -> page
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # page -> its tokens (guards hash collisions)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - self.reserved_pages

    @property
    def num_free_pages(self) -> int:
        """Pages `allocate` can hand out: truly free plus evictable cached ones."""
        return self._num_free + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    @property
    def num_earmarked_pages(self) -> int:
        """Free pages earmarked for the growth of a held run (they count as free)."""
        return int(((self._run >= 0) & (self._is_free | self._is_evictable)).sum())

    @property
    def num_cached_pages(self) -> int:
        return len(self._key_of)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_pages

    def allocate(self, n: int, after: int | None = None, reserve: int = 0) -> list[int]:
        """`n` pages with refcount 1; raises `OutOfPagesError` when fewer are free.

        `after`: the sequence's last page, whose run the new pages continue where the next pages
        are available; `reserve`: how many pages the sequence may need from here on, earmarked
        when a new run has to be opened."""
        if n > self.num_free_pages:
            raise OutOfPagesError(f"asked for {n} pages, {self.num_free_pages} free")
        pages: list[int] = []
        if after is not None:
            run, page = self._run[after], after + 1
            while len(pages) < n and page < self.num_pages and self._runnable(page) and self._run[page] in (-1, run):
                pages.append(self._take(page, run if run >= 0 else after))
                page += 1
        if len(pages) < n:
            start, length = self._find_run(max(n - len(pages), reserve))
            if start is not None:
                for page in range(start, start + length):
                    if len(pages) < n:
                        pages.append(self._take(page, start))
                    else:
                        self._run[page] = start  # earmarked
        while len(pages) < n:
            pages.append(self._take(self._any_page(), -1))
        return pages

    def _runnable(self, page: int) -> bool:
        """Free, or cached, unheld and never reused: a run may take it."""
        return bool(self._is_free[page] or (self._is_evictable[page] and not self._is_reused[page]))

    def _find_run(self, want: int) -> tuple[int | None, int]:
        """(first page, length) of where a new run of up to `want` pages goes: the first stretch
        of unearmarked free pages that long, else of free and runnable cached pages, else the
        longest of the latter; (None, 0) if there is none."""
        open_ = self._run < 0
        free = self._is_free & open_
        runnable = free | (self._is_evictable & open_ & ~self._is_reused)
        longest: tuple[int | None, int] = (None, 0)
        for mask in (free, runnable):
            edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.view(np.int8), [0]))))
            starts, lengths = edges[0::2], edges[1::2] - edges[0::2]
            fits = np.flatnonzero(lengths >= want)
            if fits.size:
                return int(starts[fits[0]]), want
            if lengths.size and lengths.max() > longest[1]:
                best = int(lengths.argmax())
                longest = (int(starts[best]), int(lengths[best]))
        return longest

    def _any_page(self) -> int:
        """A page outside any run's order: a free unearmarked one, else a free earmarked one,
        else the least recently freed cached one."""
        if self._num_free:
            candidates = np.flatnonzero(self._is_free & (self._run < 0))
            return int(candidates[0]) if candidates.size else int(np.flatnonzero(self._is_free)[0])
        return next(iter(self._evictable))

    def _take(self, page: int, run: int) -> int:
        """Hand out available `page` (free or evictable) as part of `run` (-1: none)."""
        if self._is_free[page]:
            self._is_free[page] = False
            self._num_free -= 1
        else:
            del self._evictable[page]
            self._is_evictable[page] = False
            self._forget(page)
        self._refcount[page] = 1
        self._run[page] = run
        return page

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page. Tail pages go first so they are evicted first. The
        earmarks after the last page's run are dropped."""
        run = self._run[pages[-1]] if pages else -1
        if run >= 0:
            self._run[(self._run == run) & (self._is_free | self._is_evictable)] = -1
        for page in reversed(pages):
            count = self._refcount[page]
            if count <= 0:
                raise ValueError(f"page {page} freed more often than allocated")
            self._refcount[page] = count - 1
            if count == 1:
                self._run[page] = -1
                if page in self._key_of:
                    self._evictable[page] = None
                    self._is_evictable[page] = True
                else:
                    self._is_free[page] = True
                    self._num_free += 1

    def prefix_keys(self, token_ids: list[int], num_pages: int, previous: int | None = None) -> list[int]:
        """Chained keys of the first `num_pages` full pages of `token_ids`."""
        keys, size = [], self.page_size
        for i in range(num_pages):
            previous = page_key(previous, tuple(token_ids[i * size : (i + 1) * size]))
            keys.append(previous)
        return keys

    def lookup(self, token_ids: list[int], max_pages: int) -> tuple[list[int], list[int]]:
        """Cached pages holding the longest run of leading full pages of `token_ids` (at most
        `max_pages`), with their keys. Each returned page gains a reference: `free` it later."""
        if not self.enable_prefix_cache:
            return [], []
        pages, keys, previous, size = [], [], None, self.page_size
        limit = min(max_pages, len(token_ids) // size)
        for i in range(limit):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            key = page_key(previous, tokens)
            page = self._page_of.get(key)
            if page is None or self._tokens_of[page] != tokens:
                break
            if self._refcount[page] == 0:
                del self._evictable[page]
                self._is_evictable[page] = False
            self._refcount[page] += 1
            self._is_reused[page] = True
            pages.append(page)
            keys.append(key)
            previous = key
        return pages, keys

    def register(self, page: int, key: int, tokens: tuple[int, ...]) -> None:
        """Record that held `page` is full with `tokens`, keyed `key`. A key already cached
        elsewhere keeps its page; this one then stays uncached and is plainly freed later."""
        if not self.enable_prefix_cache or key in self._page_of or page in self._key_of:
            return
        if self._refcount[page] <= 0:
            raise ValueError(f"page {page} is not held")
        self._key_of[page] = key
        self._page_of[key] = page
        self._tokens_of[page] = tokens

    def cache_entries(self) -> dict[int, int]:
        """page -> key of every cached page (held or evictable)."""
        return dict(self._key_of)

    def uncache(self, pages) -> None:
        """Forget the prefix-cache entries of `pages` (their contents are not what their keys say:
        a planned step never wrote them). An evictable one becomes plainly free."""
        for page in pages:
            if page not in self._key_of:
                continue
            self._forget(page)
            if page in self._evictable:
                del self._evictable[page]
                self._is_evictable[page] = False
                self._is_free[page] = True
                self._num_free += 1

    def _forget(self, page: int) -> None:
        key = self._key_of.pop(page)
        del self._page_of[key]
        del self._tokens_of[page]
        self._is_reused[page] = False
