"""`one_thread`: torch's CPU ops inside run on the calling thread, and only that thread's
setting changes, for the length of the block."""

from __future__ import annotations

import threading

import pytest
import torch

from tiers.codecs import threads


def test_one_thread_holds_only_the_calling_thread_and_restores_it() -> None:
    if threads._openmp() is None:
        pytest.skip("torch is not built on OpenMP here")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen: dict[str, int] = {}
        inside, release = threading.Event(), threading.Event()

        def other() -> None:
            inside.wait(10)
            seen["other"] = torch.get_num_threads()  # another thread, while the block is open
            release.set()

        t = threading.Thread(target=other)
        t.start()
        with threads.one_thread():
            seen["inside"] = torch.get_num_threads()
            with threads.one_thread():  # nested: still one, and the outer block restores
                seen["nested"] = torch.get_num_threads()
            seen["after_nested"] = torch.get_num_threads()
            inside.set()
            assert release.wait(10)
        t.join(10)
        assert seen == {"inside": 1, "nested": 1, "after_nested": 1, "other": 2}
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), threads.one_thread():
            raise RuntimeError("an error inside still restores")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_codecs_leave_the_thread_count_as_they_found_it() -> None:
    from tiers.codecs import CodecKind, build_codec

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        codec = build_codec(CodecKind.INT8, (2, 2, 16, 1, 64), torch.bfloat16)
        x = torch.randn((2, 2, 16, 1, 64)).bfloat16()
        payload = codec.encode(x)
        assert payload is not None
        codec.decode(payload, torch.empty_like(x))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
