"""KV page allocator: free list, reference counts and a prefix cache of full pages. No JAX.

A full page is keyed by `hash((previous page key, its token ids))`, a chain, so a key names the
whole prefix up to the end of that page. Cached pages whose refcount drops to 0 stay keyed and
evictable (least recently freed first); they count as free and are reused when the free list
is empty. The first `reserved_pages` ids are never handed out (page 0: padding writes).
"""

from __future__ import annotations

from collections import OrderedDict, deque


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
        self._free: deque[int] = deque(range(reserved_pages, num_pages))  # unkeyed, refcount 0
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed, refcount 0, LRU first
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
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        return len(self._key_of)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_pages

    def allocate(self, n: int) -> list[int]:
        """`n` pages with refcount 1; raises `OutOfPagesError` when fewer are free."""
        if n > self.num_free_pages:
            raise OutOfPagesError(f"asked for {n} pages, {self.num_free_pages} free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                self._forget(page)
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page. Tail pages go first so they are evicted first."""
        for page in reversed(pages):
            count = self._refcount[page]
            if count <= 0:
                raise ValueError(f"page {page} freed more often than allocated")
            self._refcount[page] = count - 1
            if count == 1:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

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
            self._refcount[page] += 1
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
                self._free.append(page)

    def _forget(self, page: int) -> None:
        key = self._key_of.pop(page)
        del self._page_of[key]
        del self._tokens_of[page]
