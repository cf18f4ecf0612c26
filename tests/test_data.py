import pytest
import torch

from data.corpus import corpus_files, load_corpus
from data.loader import GlobalBatchLoader
from data.tokenizers import ByteTokenizer
from runtime.config import ConfigError


def test_byte_tokenizer_round_trips_unicode():
    text = "def f(x):\n    return 'héllo ∑'"
    ids = ByteTokenizer().encode(text)
    assert max(ids) < 256 and len(ids) == len(text.encode("utf-8"))
    assert ByteTokenizer().decode(ids) == text


def test_default_corpus_exists_offline_and_is_ordered():
    files = corpus_files("default")
    assert len(files) > 50 and files == sorted(files)
    assert load_corpus("default", 1 << 20).numel() == 1 << 20


def test_user_source_file_and_folder(tmp_path):
    (tmp_path / "b.txt").write_text("world")
    (tmp_path / "a.txt").write_text("hello ")
    assert ByteTokenizer().decode(load_corpus(str(tmp_path), 1 << 20)) == "hello world"
    assert ByteTokenizer().decode(load_corpus(str(tmp_path / "b.txt"), 1 << 20)) == "world"


def test_missing_source_names_the_field():
    with pytest.raises(ConfigError, match=r"data.source='/no/such/path' does not exist"):
        corpus_files("/no/such/path")


def global_batches(dp_size: int, steps: int, micro_batch: int) -> list[torch.Tensor]:
    """The global batches the dp ranks consumed, reassembled in rank order."""
    tokens = torch.arange(10_000) % 251
    loaders = [
        GlobalBatchLoader(tokens, seq_len=16, global_batch=8, micro_batch=micro_batch, dp_rank=r, dp_size=dp_size)
        for r in range(dp_size)
    ]
    batches = []
    for _ in range(steps):
        per_rank = [torch.cat([x for x, _ in loader.next_batch()]) for loader in loaders]
        batches.append(torch.cat(per_rank))
    assert len({loader.tokens_consumed for loader in loaders}) == 1
    return batches


def test_two_dp_degrees_consume_the_same_global_stream():
    one = global_batches(1, steps=5, micro_batch=8)
    for dp, micro in ((2, 4), (4, 1), (8, 1)):
        for a, b in zip(one, global_batches(dp, steps=5, micro_batch=micro), strict=True):
            assert torch.equal(a, b), f"dp={dp} saw other data"


def test_targets_are_inputs_shifted_by_one_and_position_is_global():
    tokens = torch.arange(1000)
    loader = GlobalBatchLoader(tokens, seq_len=10, global_batch=4, micro_batch=1, dp_rank=1, dp_size=2)
    (x0, y0), (x1, _) = loader.next_batch()
    assert torch.equal(x0[0], torch.arange(20, 30)) and torch.equal(y0[0], torch.arange(21, 31))
    assert torch.equal(x1[0], torch.arange(30, 40))
    assert loader.state_dict() == {"tokens_consumed": 40}


def test_resuming_from_the_position_continues_the_stream_on_another_layout():
    tokens = torch.arange(5000) % 97
    a = GlobalBatchLoader(tokens, seq_len=8, global_batch=4, micro_batch=4, dp_rank=0, dp_size=1)
    for _ in range(3):
        a.next_batch()
    expected = torch.cat([x for x, _ in a.next_batch()])
    b0 = GlobalBatchLoader(tokens, seq_len=8, global_batch=4, micro_batch=2, dp_rank=0, dp_size=2)
    b1 = GlobalBatchLoader(tokens, seq_len=8, global_batch=4, micro_batch=2, dp_rank=1, dp_size=2)
    for b in (b0, b1):
        b.load_state_dict({"tokens_consumed": 3 * 4 * 8})
    resumed = torch.cat([x for b in (b0, b1) for x, _ in b.next_batch()])
    assert torch.equal(resumed, expected)


def test_the_stream_wraps_at_the_end_of_the_corpus():
    loader = GlobalBatchLoader(torch.arange(50), seq_len=10, global_batch=4, micro_batch=4, dp_rank=0, dp_size=1)
    for _ in range(5):
        ((x, y),) = loader.next_batch()
        assert x.shape == (4, 10) and torch.equal(x[:, 1:], y[:, :-1])


def test_a_corpus_shorter_than_a_window_is_refused():
    with pytest.raises(ConfigError, match="training.seq_len"):
        GlobalBatchLoader(torch.arange(10), seq_len=16, global_batch=1, micro_batch=1, dp_rank=0, dp_size=1)
