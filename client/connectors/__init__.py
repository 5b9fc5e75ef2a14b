"""Serving-engine connectors: plug kvpool into an engine's own KV-cache API.

``kvpool.client.connectors.vllm``: ``KVPoolConnector``, a vLLM ``KVConnectorBase_V1`` (loaded out of
tree, needs ``kvpool[vllm]``). The key scheme it stores under is engine-free and lives in
``vllm_keys``. ``kvpool.client.connectors.sglang``: ``KVPoolHiCacheStorage``, an SGLang HiCache
storage backend (loaded by SGLang's ``dynamic`` backend option, needs ``sglang``); its keys are in
``sglang_keys``. Nothing here is imported by ``kvpool.client``: an engine imports its connector.
"""
