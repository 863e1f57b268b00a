// The schema layer's decoders (src/schema/): kv_transfer_params, ec_transfer_params, an agent's
// address (GET /v1/kv/agent's answer) and OpenAI's error body. The first byte picks which.
// None may crash; an error names what was wrong; what a decoder accepts, its encoder writes so
// that the decoder reads back the same.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string_view>

#include "core/json_depth.h"
#include "schema/agent_address.h"
#include "schema/ec_transfer_params.h"
#include "schema/kv_transfer_params.h"
#include "schema/openai_error.h"
#include "schema/sglang_pd.h"

namespace {

namespace schema = ferry::schema;
using Json = nlohmann::json;

template <typename R>
void NamedOrAbort(const R& r) {
    if (!r.ok() && r.status().message().empty()) std::abort();
}

void KvParams(std::string_view text, schema::KvTransferMode mode) {
    auto p = schema::ParseKvTransferParamsText(text, mode);
    NamedOrAbort(p);
    if (!p.ok()) return;
    if (p->do_remote_decode && p->do_remote_prefill) std::abort();
    const std::string once = schema::KvTransferParamsJson(*p).dump();
    auto again = schema::ParseKvTransferParamsText(once, mode);
    if (!again.ok() || schema::KvTransferParamsJson(*again).dump() != once) std::abort();
}

void EcParams(std::string_view text) {
    auto p = schema::ParseEcTransferParamsText(text);
    NamedOrAbort(p);
    if (!p.ok()) return;
    if (p->engine_id.empty() || p->host.empty() || p->port < 1 || p->port > 65535) std::abort();
    auto again = schema::ParseEcTransferParams(schema::EcTransferParamsJson(*p));
    if (!again.ok() ||
        static_cast<const schema::AgentAddress&>(*again) !=
            static_cast<const schema::AgentAddress&>(*p) ||
        again->encoder != p->encoder) {
        std::abort();
    }
}

void Agent(std::string_view text) {
    if (!ferry::JsonDepthWithin(text, 8)) return;
    const Json j = Json::parse(text.begin(), text.end(), nullptr, false);
    if (j.is_discarded()) return;
    auto a = schema::ParseAgentAddress(j, "agent", "default-host");
    NamedOrAbort(a);
    if (!a.ok()) return;
    if (a->engine_id.empty() || a->host.empty() || a->port < 1 || a->port > 65535) std::abort();
    auto again = schema::ParseAgentAddress(schema::AgentAddressJson(*a), "agent");
    if (!again.ok() || *again != *a) std::abort();
}

void Error(std::string_view text) {
    auto e = schema::ParseOpenAiError(text);
    NamedOrAbort(e);
    if (!e.ok()) return;
    const std::string back = schema::OpenAiErrorJson(500, *e, e->request_id)
                                 .dump(-1, ' ', false, Json::error_handler_t::replace);
    auto again = schema::ParseOpenAiError(back);
    if (!again.ok()) std::abort();
}

// SGLang's PD fields: what is accepted is in range; a prefill worker's bootstrap answer reads
// back what it writes.
void Sglang(std::string_view text, size_t batch) {
    if (!ferry::JsonDepthWithin(text, 8)) return;
    const Json j = Json::parse(text.begin(), text.end(), nullptr, false);
    if (j.is_discarded()) return;
    auto b = schema::ParseSglangBootstrap(j, batch);
    NamedOrAbort(b);
    if (b.ok() && *b) {
        if ((*b)->size() != (batch == 0 ? 1 : batch)) std::abort();
        for (const auto& e : **b) {
            if (e.host.empty() || e.host.size() > 255 || e.port < 0 || e.port > 65535 ||
                e.room > uint64_t(INT64_MAX)) {
                std::abort();
            }
        }
    }
    auto info = schema::ParseSglangPrefillInfo(j);
    NamedOrAbort(info);
    if (!info.ok()) return;
    auto again = schema::ParseSglangPrefillInfo(schema::SglangPrefillInfoJson(*info));
    if (!again.ok() || again->agent != info->agent || again->tp_size != info->tp_size) {
        std::abort();
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
    switch (data[0] % 6) {
        case 0:
            KvParams(text, schema::KvTransferMode::kPull);
            break;
        case 1:
            KvParams(text, schema::KvTransferMode::kPush);
            break;
        case 2:
            EcParams(text);
            break;
        case 3:
            Agent(text);
            break;
        case 4:
            Error(text);
            break;
        default:
            Sglang(text, (data[0] / 6) % 4);
            break;
    }
    return 0;
}
