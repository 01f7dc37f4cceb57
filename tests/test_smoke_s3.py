import torch
from tensordict import TensorDict

import zstore


def test_roundtrip_every_location(location):
    url = location.new()
    s = zstore.LazyMemmapStorage(50, scratch_dir=url, storage_options=location.options)
    td = TensorDict(obs=torch.randn(20, 3), batch_size=[20])
    s.set(torch.arange(20), td)
    s.flush()
    again = zstore.open(url, location.options)
    assert len(again) == 20
    assert torch.equal(again[:]["obs"], td["obs"])
