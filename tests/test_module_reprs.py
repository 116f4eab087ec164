"""The primitives' modules name their partitions and arguments, as the layers and torch's modules do."""

import distdl.nn as dnn
from helpers import sizes


@sizes(1, 2)
def test_reprs_name_the_arguments(P_world, comm):
    n = comm.size
    P = P_world.create_cartesian_topology_partition((1, n))
    root = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1,))
    widths = [[0, 0], [1, 1]]
    expected = {
        dnn.Broadcast(root, P): f"Broadcast(P_x shape=(1,), P_y shape=(1, {n}), transpose_src=False, "
                                "transpose_dest=False, preserve_batch=True)",
        dnn.SumReduce(P, root, preserve_batch=False): f"SumReduce(P_x shape=(1, {n}), P_y shape=(1,), transpose_src="
                                                      "False, transpose_dest=False, preserve_batch=False)",
        dnn.AllSumReduce(P, axes_keep=[0]): f"AllSumReduce(P_x shape=(1, {n}), axes_reduce=(1,))",
        dnn.AllGather(P, axes_all_gather=[1]): f"AllGather(P_x shape=(1, {n}), axes_all_gather=(1,))",
        dnn.ReduceScatter(P, axes_reduce_scatter=[1]): f"ReduceScatter(P_x shape=(1, {n}), axes_reduce_scatter=(1,))",
        dnn.Repartition(P, P): f"Repartition(P_x shape=(1, {n}), P_y shape=(1, {n}), preserve_batch=True)",
        dnn.AllSumReduceForward(P, axes_reduce=[1]): f"AllSumReduceForward(P_x shape=(1, {n}), axes_reduce=(1,))",
        dnn.AllSumReduceBackward(P, axes_reduce=[1]): f"AllSumReduceBackward(P_x shape=(1, {n}), axes_reduce=(1,))",
        dnn.HaloExchange(P, widths, widths, widths): f"HaloExchange(P_x shape=(1, {n}), halo_shape=((0, 0), (1, 1)), "
                                                    "recv_buffer_shape=((0, 0), (1, 1)), "
                                                    "send_buffer_shape=((0, 0), (1, 1)))",
    }
    for module, text in expected.items():
        assert repr(module) == text
