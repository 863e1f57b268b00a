#include "kv/kv_transfer_params.h"

namespace ferry::kv {

namespace {

Result<std::shared_ptr<KvTransferParams>> Wrap(Result<schema::KvTransferParams> p) {
    if (!p.ok()) return p.status();
    if (!p->do_remote_decode && !p->do_remote_prefill) {
        return std::shared_ptr<KvTransferParams>();
    }
    return std::make_shared<KvTransferParams>(std::move(*p));
}

}  // namespace

Result<std::shared_ptr<KvTransferParams>> ParseConnectorKvParams(const nlohmann::json& params,
                                                                 KvTransferMode default_mode) {
    return Wrap(schema::ParseKvTransferParams(params, default_mode));
}

Result<std::shared_ptr<KvTransferParams>> ParseConnectorKvParamsText(std::string_view json,
                                                                     KvTransferMode default_mode) {
    return Wrap(schema::ParseKvTransferParamsText(json, default_mode));
}

}  // namespace ferry::kv
