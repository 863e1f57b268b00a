// `python3 -m sglang.launch_server`'s command line, as `ferry serve` takes it
// (docs/coming-from.md): an SGLang user's PD command runs with `ferry serve` in place of
// `python3 -m sglang.launch_server` and a GGUF file in place of the model.
//
// TranslateSglangServeArgs rewrites SGLang's flags into ferry's before they are parsed (and before
// vLLM's, serve/vllm_cli.h; the two vocabularies do not overlap):
//   - `--model-path M` is `--model M`, served under M as SGLang does (unless
//     --served-model-name); `--tp-size` / `--tp` is `--tp`; `--context-length` is
//     `--max-model-len`; `--page-size` is `--block-size`; `--max-running-requests` is
//     `--max-num-seqs`; `--chunked-prefill-size N` is `--max-num-batched-tokens N` (-1:
//     `--no-chunked-prefill`); `--disable-radix-cache` is `--no-prefix-caching`;
//   - `--disaggregation-mode prefill|decode|null` is the role; `--disaggregation-bootstrap-port P`
//     is `--bootstrap-port P` (a prefill worker serves SGLang's bootstrap server there, 8998 by
//     default as SGLang's); `--disaggregation-transfer-backend mooncake|nixl` is noted (ferry's
//     own transfer engine moves the KV: shm on one host, tcp or ucx between hosts);
//   - SGLang's default port (30000) when none is given;
//   - `--dp-size` / `--pp-size` of 1 are noted and any other refused; flags with no meaning on
//     ferry (memory fraction, CUDA graphs, remote code, ...) are dropped with a note each.
// Every other argument passes through, so what neither ferry nor this table knows is refused by
// name when the command is parsed. Arguments without an SGLang-only flag pass through untouched.
#pragma once

#include <string>
#include <vector>

#include "ferry/status.h"
#include "serve/vllm_cli.h"

namespace ferry::serve {

// InvalidArgument naming the flag: one that needs a value without one, a mode or size ferry has
// no equivalent of.
Result<TranslatedArgs> TranslateSglangServeArgs(const std::vector<std::string>& args);

}  // namespace ferry::serve
