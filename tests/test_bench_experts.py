"""`meshrl bench experts` (meshrl/tools/bench/experts.py) on real gloo ranks: the bytes each rank reads of a tiny
MoE fall with the rank count, each rank reading no more than its share (its experts plus every dense tensor),
where reading every expert whole (the old way) takes more than that share."""

import json

import pytest

pytestmark = pytest.mark.processes


def test_per_rank_bytes_read_fall_with_the_rank_count_within_each_ranks_share(tmp_path, cli):
    out = tmp_path / "experts.json"
    code, stdout, _ = cli("bench", "experts", "--json", out, "--ranks", "1,3")
    assert code == 0 and "peak added" in stdout
    result = json.loads(out.read_text())
    one, three = result["worlds"]["1"], result["worlds"]["3"]
    # one rank reads every tensor of the files once: the counting reader counts what is read
    assert one[0]["read_bytes"]["sharded"] == result["expert_bytes"] + result["dense_bytes"]
    # 16 experts over 3 ranks: 6, 6 and 4
    assert [r["share_bytes"] - result["dense_bytes"] for r in three] == [result["expert_bytes"] * n // 16
                                                                         for n in (6, 6, 4)]
    for rank in three:
        assert rank["read_bytes"]["sharded"] <= rank["share_bytes"]
        assert rank["read_bytes"]["whole"] > rank["share_bytes"]
    assert max(r["read_bytes"]["sharded"] for r in three) < one[0]["read_bytes"]["sharded"]
