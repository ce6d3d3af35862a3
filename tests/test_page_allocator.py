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


def test_a_run_continues_after_its_last_page_and_others_skip_its_earmarks():
    alloc = PageAllocator(num_pages=12, page_size=4)
    a = alloc.allocate(2, reserve=4)  # opens a run: pages 1-2 held, 3-4 earmarked
    b = alloc.allocate(2, reserve=4)  # the next run starts past a's earmarks
    assert a == [1, 2] and b == [5, 6]
    assert alloc.allocate(1, after=a[-1], reserve=2) == [3]
    assert alloc.allocate(2, after=b[-1], reserve=2) == [7, 8]
    assert alloc.allocate(1, after=3, reserve=1) == [4]
    # earmarks still count as free pages
    assert alloc.num_free_pages == 11 - 8


def test_earmarks_are_soft_and_dropped_when_their_run_is_freed():
    alloc = PageAllocator(num_pages=9, page_size=4)
    a = alloc.allocate(1, reserve=4)  # 1 held, 2-4 earmarked
    b = alloc.allocate(2, reserve=4)  # 5-6 held, 7-8 earmarked
    assert (a, b) == ([1], [5, 6])
    # nothing unearmarked is left: a new sequence takes earmarked pages rather than fail
    c = alloc.allocate(2, reserve=2)
    assert len(c) == 2 and not set(c) & {1, 5, 6} and alloc.num_free_pages == 3
    alloc.free(b)  # b's remaining earmarks go with it
    alloc.free(c)
    assert alloc.num_earmarked_pages == 1  # a's page 4
    assert alloc.allocate(4, reserve=4) == [5, 6, 7, 8]


def test_freeing_drops_earmarks_so_a_new_run_can_use_them():
    alloc = PageAllocator(num_pages=9, page_size=4)
    a = alloc.allocate(1, reserve=8)  # 1 held, 2-8 earmarked
    assert alloc.allocate(2, reserve=2) == [2, 3]  # only earmarked pages left: taken all the same
    alloc.free([2, 3])
    assert alloc.num_earmarked_pages == 5
    alloc.free(a)  # its earmarks 4-8 go too, though 2 and 3 no longer lead to them
    assert alloc.num_earmarked_pages == 0
    assert alloc.allocate(3, reserve=8) == [1, 2, 3] and alloc.num_earmarked_pages == 5


def test_growth_takes_an_unearmarked_next_page_but_not_another_runs():
    alloc = PageAllocator(num_pages=10, page_size=4)
    a = alloc.allocate(1)  # no reserve: a run of one
    b = alloc.allocate(1, reserve=3)  # 2 held, 3-4 earmarked for b
    assert (a, b) == ([1], [2])
    grown = alloc.allocate(1, after=a[-1], reserve=3)  # 2 is b's: a opens a new run elsewhere
    assert grown == [5]
    assert alloc.allocate(2, after=grown[-1], reserve=2) == [6, 7]


def test_a_new_run_prefers_free_pages_then_unreused_cached_ones_never_reused_ones():
    alloc = PageAllocator(num_pages=11, page_size=2)
    tokens = list(range(1, 21))
    pages = alloc.allocate(10)  # all of them
    register_all(alloc, pages[:8], tokens[:16])  # pages 1-8 cached, 9-10 plain
    alloc.free(pages[8:])  # 9, 10 free
    alloc.free(pages[:4])  # 1-4 evictable, not reused
    hit, _ = alloc.lookup(tokens[:8], max_pages=4)  # 1-4 reused now
    alloc.free(hit)
    alloc.free(pages[4:8])  # 5-8 evictable, not reused
    assert alloc.allocate(2, reserve=2) == [9, 10]  # free pages first
    run = alloc.allocate(3, reserve=3)
    assert run == [5, 6, 7]  # then cached pages nobody reused, as a run
    assert alloc.num_cached_pages == 5
    assert alloc.lookup(tokens[:8], max_pages=4)[0] == [1, 2, 3, 4]  # the reused prefix survived


def test_scattered_free_pages_fall_back_to_the_longest_stretch():
    alloc = PageAllocator(num_pages=12, page_size=4)
    held = alloc.allocate(11)
    alloc.free([held[i] for i in (1, 3, 4, 7, 8, 9)])  # free: 2, 4-5, 8-10
    assert alloc.allocate(5, reserve=5)[:3] == [8, 9, 10]
