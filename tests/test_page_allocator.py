"""PageAllocator: free list, refcounts, prefix cache (hash chain, LRU eviction)."""

from __future__ import annotations

import pytest

from worker.engine.page_allocator import OutOfPagesError, PageAllocator, page_key


def register_all(alloc: PageAllocator, pages: list[int], tokens: list[int]) -> list[int]:
    keys = alloc.prefix_keys(tokens, len(pages))
    size = alloc.page_size
    for i, (page, key) in enumerate(zip(pages, keys)):
        alloc.register(page, key, tuple(tokens[i * size : (i + 1) * size]))
    return keys


def test_allocate_and_free_keep_reserved_page_out():
    alloc = PageAllocator(num_pages=6, page_size=4)
    assert alloc.num_usable_pages == 5 and alloc.num_free_pages == 5
    pages = alloc.allocate(5)
    assert sorted(pages) == [1, 2, 3, 4, 5]
    assert all(alloc.refcount(p) == 1 for p in pages)
    assert alloc.num_free_pages == 0 and not alloc.can_allocate(1) and alloc.can_allocate(0)
    with pytest.raises(OutOfPagesError):
        alloc.allocate(1)
    alloc.free(pages[:2])
    assert alloc.num_free_pages == 2 and alloc.num_used_pages == 3
    alloc.free(pages[2:])
    assert alloc.num_free_pages == 5
    with pytest.raises(ValueError):
        alloc.free([pages[0]])


def test_reserved_pages_parameter():
    alloc = PageAllocator(num_pages=5, page_size=2, reserved_pages=3)
    assert sorted(alloc.allocate(2)) == [3, 4]
    assert PageAllocator(num_pages=3, page_size=2, reserved_pages=0).allocate(3) == [0, 1, 2]
    with pytest.raises(ValueError):
        PageAllocator(num_pages=2, page_size=2, reserved_pages=2)


def test_lookup_hits_longest_prefix_and_counts_references():
    alloc = PageAllocator(num_pages=10, page_size=4)
    tokens = list(range(100, 114))  # 3 full pages + 2 tokens
    pages = alloc.allocate(4)
    keys = register_all(alloc, pages[:3], tokens)
    hit, hit_keys = alloc.lookup(tokens, max_pages=10)
    assert hit == pages[:3] and hit_keys == keys
    assert [alloc.refcount(p) for p in pages] == [2, 2, 2, 1]
    # a different third page: only the first two match; a different first token: nothing
    other = tokens[:8] + [7, 7, 7, 7]
    assert alloc.lookup(other, max_pages=10)[0] == pages[:2]
    assert alloc.lookup([0] + tokens[1:], max_pages=10) == ([], [])
    assert alloc.lookup(tokens, max_pages=1)[0] == pages[:1]
    assert [alloc.refcount(p) for p in pages] == [4, 3, 2, 1]


def test_freed_cached_pages_are_evictable_and_count_as_free():
    alloc = PageAllocator(num_pages=5, page_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    pages = alloc.allocate(3)
    register_all(alloc, pages, tokens)
    alloc.free(pages)
    assert alloc.num_free_pages == 4 and alloc.num_cached_pages == 3
    assert all(alloc.is_evictable(p) for p in pages)
    hit, _ = alloc.lookup(tokens, max_pages=3)  # revives them
    assert hit == pages and alloc.num_free_pages == 1
    assert not any(alloc.is_evictable(p) for p in pages)
    alloc.free(hit)
    # the truly free page goes first, then evictable pages, tail of the chain first
    assert alloc.allocate(1)[0] not in pages
    second = alloc.allocate(1)[0]
    assert second == pages[2]
    assert alloc.lookup(tokens, max_pages=3)[0] == pages[:2]  # its key is gone with it
    assert alloc.num_cached_pages == 2


def test_duplicate_key_keeps_first_page():
    alloc = PageAllocator(num_pages=4, page_size=2)
    a, b = alloc.allocate(2)
    key = page_key(None, (1, 2))
    alloc.register(a, key, (1, 2))
    alloc.register(b, key, (1, 2))
    alloc.free([a, b])
    assert alloc.is_evictable(a) and not alloc.is_evictable(b)
    assert alloc.num_cached_pages == 1 and alloc.num_free_pages == 3


def test_lookup_verifies_tokens_against_key_collisions():
    alloc = PageAllocator(num_pages=4, page_size=2)
    page = alloc.allocate(1)[0]
    alloc.register(page, page_key(None, (1, 2)), (9, 9))  # as if (9, 9) hashed like (1, 2)
    assert alloc.lookup([1, 2], max_pages=1) == ([], [])


def test_disabled_prefix_cache_never_hits():
    alloc = PageAllocator(num_pages=4, page_size=2, enable_prefix_cache=False)
    pages = alloc.allocate(2)
    register_all(alloc, pages, [1, 2, 3, 4])
    alloc.free(pages)
    assert alloc.num_cached_pages == 0 and alloc.num_free_pages == 3
    assert alloc.lookup([1, 2, 3, 4], max_pages=2) == ([], [])


def test_uncache_forgets_held_and_evictable_pages():
    alloc = PageAllocator(num_pages=8, page_size=2)
    tokens = [5, 6, 7, 8, 9, 10]
    pages = alloc.allocate(3)
    keys = register_all(alloc, pages, tokens)
    assert alloc.cache_entries() == dict(zip(pages, keys))
    alloc.free(pages[1:])  # two evictable, one still held
    alloc.uncache([pages[0], pages[2], 99])  # an uncached page is ignored
    assert alloc.cache_entries() == {pages[1]: keys[1]}
    assert alloc.lookup(tokens, 3) == ([], [])  # the chain starts at the forgotten first page
    assert not alloc.is_evictable(pages[2]) and alloc.num_free_pages == 6
    alloc.free(pages[:1])  # the held one goes back plainly free
    assert not alloc.is_evictable(pages[0]) and alloc.num_free_pages == 7 and alloc.num_cached_pages == 1
