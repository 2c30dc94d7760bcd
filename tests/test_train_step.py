"""How a step's episodes become updates and micro-batches (pure logic; the real trainer runs them in
test_decoupled_ratio.py)."""

from meshrl.train_step import micro_batches, split
from meshrl.types import Episode


def test_split_gives_nearly_equal_consecutive_mini_batches():
    assert split(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert split(list(range(6)), 3) == [[0, 1], [2, 3], [4, 5]]
    assert split(list(range(7)), 1) == [list(range(7))]
    assert split([0, 1], 4) == [[0], [1]]  # never an empty update while there are episodes
    assert split([], 3) == [[]]  # nothing to train: one (empty) update, so the step still happens


def test_micro_batches_normalise_by_their_whole_mini_batch():
    episodes = [Episode([1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], 1.0, 0, 0),
                Episode([1, 2], [False, True], [0.0, -1.0], -1.0, 0, 0),
                Episode([4, 5, 6, 7], [False, False, True, True], [0.0, 0.0, -1.0, -1.0], 0.5, 0, 1)]
    batches = micro_batches(episodes, size=2, pad_id=0)
    assert [b.input_ids.shape[0] for b in batches] == [2, 1]
    assert all(b.loss_tokens == 5 and b.loss_sequences == 3 for b in batches)
    assert sum(int(b.loss_mask.sum()) for b in batches) == 5
    assert all(b.old_logprobs is None for b in batches)  # the first update's pi_old is its own forward
