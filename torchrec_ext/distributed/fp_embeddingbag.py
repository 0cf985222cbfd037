"""ShardedFeatureProcessedDynamicEmbeddingBagCollection: TorchRec's
FeatureProcessedEmbeddingBagCollection over a DynamicEmbeddingBagCollection, sharded.

TorchRec's sharded FP-EBC (``torchrec.distributed.fp_embeddingbag``) with our sharded EBC
inside. Two things differ from TorchRec's, both for the dynamic EBC:

- Each id's position in its bag is written into the KJT's weights before the input dist, for
  every sharding type (TorchRec does it for the row types only): the weighted dynamic EBC's
  input dist sends the weights a weighted module reads, and a bag's ids keep their positions
  wherever they are looked up. The ranks' feature processors then read them (``_pre_processed``)
  and gather their position weights, whose gradients flow back through the local lookups.
- The position weights are dense parameters (DDP averages their gradient over the ranks), but a
  rank's gradient of them is its part of the whole batch's gradient (from the ids it looked up,
  every rank's bags), which TorchRec's reduce-scatter has already divided by the world size. It
  is multiplied back, so after DDP's mean the position weights get what they would in the
  unsharded FP-EBC trained on the ranks' mean loss, as the tables and the other dense
  parameters do (and as TorchRec's sharded FP-EBC over its own EBC gives them).
"""

from __future__ import annotations

import torch
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_types import KJTList, ShardedEmbeddingModule
from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.distributed.utils import init_parameters
from torchrec.modules.feature_processor_ import FeatureProcessorsCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_ext.distributed.pooled_output_dist import ScaleGradient


class ShardedFeatureProcessedDynamicEmbeddingBagCollection(ShardedFeatureProcessedEmbeddingBagCollection):
    def __init__(
        self,
        module: FeatureProcessedEmbeddingBagCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        ebc_sharder,
        env: ShardingEnv,
        device: torch.device,
        module_fqn: str | None = None,
    ) -> None:
        # TorchRec's constructor, but for our sharded EBC, which has no fbgemm lookups (``_lookups``).
        ShardedEmbeddingModule.__init__(self)
        self._device, self._env = device, env
        self._embedding_bag_collection = ebc_sharder.shard(
            module._embedding_bag_collection,
            table_name_to_parameter_sharding,
            env=env,
            device=device,
            module_fqn=module_fqn,
        )
        # Positions always travel with the ids (see the module docstring): TorchRec's flag for it.
        self._row_wise_sharded = True
        self._is_collection = isinstance(module._feature_processors, FeatureProcessorsCollection)
        self._feature_processors = (
            module._feature_processors
            if self._is_collection
            else torch.nn.ModuleDict(module._feature_processors.items())
        )
        init_parameters(self._feature_processors, device)
        self._no_op_zero = torch.zeros((1,), device=self._device)

    def apply_feature_processors_to_kjt_list(self, dist_input: KJTList) -> KJTList:
        processed = super().apply_feature_processors_to_kjt_list(dist_input)
        factor = float(self._env.world_size) if get_gradient_division() else 1.0
        if factor == 1.0:
            return processed
        return KJTList(
            [
                KeyedJaggedTensor(
                    keys=kjt.keys(),
                    values=kjt.values(),
                    weights=ScaleGradient.apply(kjt.weights(), factor),
                    lengths=kjt.lengths(),
                    stride=kjt.stride(),
                )
                for kjt in processed
            ]
        )

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        pass  # our sharded EBC registers its tables when built
