// The built-in KV connector's kv_transfer_params: the schema's struct and codec
// (schema/kv_transfer_params.h) behind the connector seam's type (kv/connector.h).
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>

#include "ferry/status.h"
#include "kv/connector.h"
#include "schema/kv_transfer_params.h"

namespace ferry::kv {

using KvTransferMode = schema::KvTransferMode;

struct KvTransferParams final : ConnectorParams, schema::KvTransferParams {
    KvTransferParams() = default;
    explicit KvTransferParams(schema::KvTransferParams p)
        : schema::KvTransferParams(std::move(p)) {}

    bool prefill_only() const override { return do_remote_decode; }
    bool loads_kv() const override { return do_remote_prefill; }
    nlohmann::json ToJson() const override { return schema::KvTransferParamsJson(*this); }
};

// schema::ParseKvTransferParams(Text), and null when neither do_remote_decode nor
// do_remote_prefill is set (the request is not the connector's).
Result<std::shared_ptr<KvTransferParams>> ParseConnectorKvParams(const nlohmann::json& params,
                                                                 KvTransferMode default_mode);
Result<std::shared_ptr<KvTransferParams>> ParseConnectorKvParamsText(std::string_view json,
                                                                     KvTransferMode default_mode);

// The built-in connector's params behind the seam's type (the connector gets only what its
// ParseParams made, or what a test built as KvTransferParams).
inline const KvTransferParams& AsKvTransferParams(const ConnectorParams& p) {
    return static_cast<const KvTransferParams&>(p);
}

}  // namespace ferry::kv
