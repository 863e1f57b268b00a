// ec_transfer_params, the object an encode worker's answer carries and the router copies into
// the requests it sends on (EPD, docs/disaggregation.md "Encoder disaggregation"): where the
// image embeddings wait (the producer's agent) and which vision encoder made them. Written by
// the producer (serve::EcConnector::Params), read by every consumer. The layer's rules:
// schema/agent_address.h.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"
#include "schema/agent_address.h"

namespace ferry::schema {

struct EcTransferParams : AgentAddress {
    // The producer's vision encoder (model::VisionEncoder::fingerprint); optional, "" when not
    // given. A consumer with another encoder does not pull (the slot's own copy is checked too).
    std::string encoder;
    // The request's images as the producer keyed them (mm_hash: 64 lowercase hex digits each,
    // at most kMaxEcHashes); optional, empty when not given. A consumer renews their leases
    // with the producer while the request waits to load them.
    std::vector<std::string> mm_hashes;
};
inline constexpr size_t kMaxEcHashes = 256;

// {"engine_id", "host", "port", "encoder"}, and "mm_hashes" when there are any.
nlohmann::json EcTransferParamsJson(const EcTransferParams& p);
// engine_id, host and port required (schema::ParseAgentAddress), encoder at most 128
// characters; unknown fields ignored. InvalidArgument naming the field.
Result<EcTransferParams> ParseEcTransferParams(const nlohmann::json& params);
// The same from text (a fuzzer's input): nesting past 8 levels and text that is not JSON are
// refused by name first.
Result<EcTransferParams> ParseEcTransferParamsText(std::string_view json);

}  // namespace ferry::schema
