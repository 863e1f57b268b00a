// `vllm serve`'s command line, as `ferry serve` takes it (docs/coming-from.md): a vLLM user's
// command runs with `ferry serve` in place of `vllm serve` and a GGUF file in place of the model.
//
// TranslateVllmServeArgs rewrites vLLM's spelling into ferry's flags before they are parsed:
//   - underscores in a flag's name are dashes (`--tensor_parallel-size`, as vLLM's parser takes);
//   - a first argument that is not a flag is the model (`vllm serve MODEL`), served under that
//     name as vLLM does unless --served-model-name says otherwise;
//   - `--tensor-parallel-size` / `-tp` is `--tp`; `--enable-chunked-prefill [true|false]`,
//     `--no-enable-chunked-prefill`, `--enable-prefix-caching [true|false]` and
//     `--no-enable-prefix-caching` are ferry's `--no-chunked-prefill` / `--no-prefix-caching`;
//   - `--kv-transfer-config JSON` (vLLM's KVTransferConfig): `kv_connector` names the protocol
//     (NixlConnector, DynamoNixlConnector: pull; MooncakeConnector, P2pNcclConnector: push),
//     `kv_role` the role (kv_producer: prefill; kv_consumer: decode; kv_both: decode, which
//     both holds and loads KV), `engine_id` the agent's name,
//     `kv_connector_extra_config.backends` the transfer backend and `skip_sampling` a prefill
//     worker; the fields with no meaning on ferry are noted, an unknown field or connector is
//     refused by name;
//   - `--ec-transfer-config JSON` (vLLM's ECTransferConfig, EPD): ECExampleConnector and
//     ECSharedStorageConnector are ferry's disk connector on `shared_storage_path` (vLLM's file
//     layout, so consumers need no ec_transfer_params); `ec_role` ec_producer is an encode worker
//     (it needs ferry's --mmproj: vLLM's model holds its vision tower, a GGUF file does not),
//     ec_consumer and ec_both load from the directory;
//   - `--kv-events-config JSON` (vLLM's KVEventsConfig): with enable_kv_cache_events and the zmq
//     publisher (vLLM's default when enabled), ferry's --kv-events-endpoint (vLLM's default
//     tcp://*:5557), --kv-events-replay-endpoint and --kv-events-topic;
//   - flags with no meaning on ferry (GPU memory, swap space, CUDA graphs, remote code) are
//     dropped, each with a note.
// Every other argument passes through unchanged, so a flag neither ferry nor this table knows
// is still refused by name when the command is parsed.
#pragma once

#include <string>
#include <vector>

#include "ferry/status.h"

namespace ferry::serve {

struct TranslatedArgs {
    std::vector<std::string> args;   // ferry serve's
    std::vector<std::string> notes;  // one line per vLLM setting taken or ignored, for the log
};

// InvalidArgument naming the flag or field: a --kv-transfer-config that is not a JSON object,
// names an unknown field or a connector ferry has no equivalent of, or asks a role the command
// contradicts; a flag that needs a value without one.
Result<TranslatedArgs> TranslateVllmServeArgs(const std::vector<std::string>& args);

}  // namespace ferry::serve
