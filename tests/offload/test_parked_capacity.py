"""How tiers' host pools grow (hearth.offload.parked.grown_capacity) and the room a state read back
from a chat file gets (``headroom``): powers of two, so the planned coarse step (compiled per power
of two of the pool's pages) meets the same few sizes in every process."""

from hearth.offload.parked import grown_capacity, headroom


def test_pools_grow_to_the_next_power_of_two():
    assert [grown_capacity(n) for n in (1, 2, 3, 64, 65, 1025, 1026, 4097)] == [1, 2, 4, 64, 128, 2048, 2048, 8192]
    # a pool doubling from a power of two stays on them; one resumed at an odd size lands back on one
    assert grown_capacity(2048 + 1) == 4096 and grown_capacity(1025 + headroom(1025) + 1) == 2048


def test_a_state_read_back_gets_an_eighth_more_room():
    assert [headroom(n) for n in (0, 1, 8, 1025, 65600)] == [1, 1, 1, 128, 8200]
