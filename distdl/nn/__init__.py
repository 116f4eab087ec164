"""Distributed modules: the data-movement primitives and the layers built from them."""

from distdl.nn.all_gather import AllGather
from distdl.nn.all_sum_reduce import AllSumReduce
from distdl.nn.batchnorm import DistributedBatchNorm
from distdl.nn.broadcast import Broadcast
from distdl.nn.clip import clip_grad_norm_
from distdl.nn.conv import DistributedConv1d, DistributedConv2d, DistributedConv3d
from distdl.nn.conv_channel import DistributedChannelConv1d, DistributedChannelConv2d, DistributedChannelConv3d
from distdl.nn.conv_feature import DistributedFeatureConv1d, DistributedFeatureConv2d, DistributedFeatureConv3d
from distdl.nn.conv_general import DistributedGeneralConv1d, DistributedGeneralConv2d, DistributedGeneralConv3d
from distdl.nn.data_parallel import DataParallel, all_reduce_gradients
from distdl.nn.embedding import DistributedEmbedding
from distdl.nn.grad_scaler import GradScaler
from distdl.nn.halo_exchange import HaloExchange
from distdl.nn.invariant import AllSumReduceBackward, AllSumReduceForward
from distdl.nn.layernorm import DistributedLayerNorm
from distdl.nn.linear import DistributedLinear
from distdl.nn.linear_all_gather import DistributedLinearAllGather
from distdl.nn.linear_reduce_scatter import DistributedLinearReduceScatter
from distdl.nn.loss import (DistributedBCELoss, DistributedBCEWithLogitsLoss, DistributedCrossEntropyLoss,
                            DistributedKLDivLoss, DistributedL1Loss, DistributedMSELoss, DistributedPoissonNLLLoss)
from distdl.nn.pooling import (DistributedAvgPool1d, DistributedAvgPool2d, DistributedAvgPool3d, DistributedMaxPool1d,
                               DistributedMaxPool2d, DistributedMaxPool3d)
from distdl.nn.reduce_scatter import ReduceScatter
from distdl.nn.repartition import Repartition
from distdl.nn.sum_reduce import SumReduce
from distdl.nn.upsampling import DistributedUpsample

__all__ = [
    # primitives
    "AllGather", "AllSumReduce", "AllSumReduceBackward", "AllSumReduceForward", "Broadcast", "HaloExchange",
    "ReduceScatter", "Repartition", "SumReduce",
    # layers
    "DistributedAvgPool1d", "DistributedAvgPool2d", "DistributedAvgPool3d", "DistributedBatchNorm",
    "DistributedBCELoss", "DistributedBCEWithLogitsLoss", "DistributedChannelConv1d", "DistributedChannelConv2d",
    "DistributedChannelConv3d", "DistributedConv1d", "DistributedConv2d", "DistributedConv3d",
    "DistributedCrossEntropyLoss", "DistributedEmbedding", "DistributedFeatureConv1d", "DistributedFeatureConv2d",
    "DistributedFeatureConv3d", "DistributedGeneralConv1d", "DistributedGeneralConv2d", "DistributedGeneralConv3d",
    "DistributedKLDivLoss", "DistributedL1Loss", "DistributedLayerNorm", "DistributedLinear",
    "DistributedLinearAllGather", "DistributedLinearReduceScatter", "DistributedMaxPool1d", "DistributedMaxPool2d",
    "DistributedMaxPool3d", "DistributedMSELoss", "DistributedPoissonNLLLoss", "DistributedUpsample",
    # data parallelism and training
    "DataParallel", "GradScaler", "all_reduce_gradients", "clip_grad_norm_",
]
