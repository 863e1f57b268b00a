// Images in chat requests: each image_url part read (data: or file:// URL) and decoded off the
// I/O threads, its embeddings found in the encoder cache by mm_hash or computed by the vision
// encoder, placed at its placeholder tokens (engine::MmInput). A bad image is a 400 naming its
// part; memory stays bounded: one image is decoded at a time, and the queue of requests
// waiting for it is capped (503 beyond).
#include "core/clock.h"
#include "core/json_fields.h"
#include "serve/openai_server_parts.h"

namespace ferry::serve {

Status OpenAiServer::Impl::EncodeImages(ParsedRequest* pr, BadRequest* bad,
                                        const http::Exchange* ex) {
    for (tokenizer::ImagePart& part : pr->images) {
        // A client that left is not worked for: checked before each image (one image's decoding
        // and encoding is the most it still costs).
        if (ex && ex->closed()) return CancelledError("the client went away");
        const Clock::time_point t0 = Clock::now();
        Result<media::Image> image = [&]() -> Result<media::Image> {
            FERRY_ASSIGN_OR_RETURN(std::string bytes, media::ReadImageUrl(part.url, config.media));
            part.url.clear();  // a data: URL's copy of the bytes goes now
            part.url.shrink_to_fit();
            return media::DecodeImage(bytes, config.media.limits);
        }();
        if (!image.ok()) {
            *bad = {fmt::format("{}: {}", part.param, image.status().message()),
                    part.param + ".url", "invalid_image"};
            return image.status();
        }
        ++image_metrics.images;
        image_metrics.decode_micros += MicrosSince(t0);
        std::string hash = image->HashHex();
        media::Embeddings e = encoder_cache->Find(hash);
        const size_t floats =
            size_t(image_tokens.tokens_per_image) * size_t(config.vision->config().out_dim);
        if (e && pr->ec_source && config.ec_connector && !config.encode_only) {
            // Cached here: the encode worker's entry for this request is not needed.
            config.ec_connector->Release(hash, pr->ec_source.get());
        }
        if (!e && config.ec_connector && !config.encode_only) {
            // EPD: an encode worker computed it (or the shared directory holds it).
            Result<media::Embeddings> got =
                config.ec_connector->Load(hash, floats, pr->ec_source.get());
            if (got.ok()) {
                e = std::move(*got);
                if (config.ec_connector->Cacheable()) {
                    encoder_cache->Insert(hash, e);
                } else {
                    pr->no_cache = true;  // this request's alone
                }
            } else if (got.status().code() != Code::kNotFound || pr->ec_source ||
                       config.ec_connector->FindsWithoutParams()) {
                // Expected there and not found, or the producer failed.
                if (config.ec_load_failure == EcLoadFailure::kFail) {
                    *bad = {fmt::format("{}: its embeddings could not be loaded "
                                        "(--ec-load-failure fail): {}",
                                        part.param, got.status().message()),
                            part.param, "ec_load_failed"};
                    return UnavailableError(got.status().message());  // 503
                }
                FERRY_LOG(kInfo, "images: {}: encoding here: {}", part.param,
                          got.status().message());
                ++image_metrics.ec_fallbacks;
            }
        }
        if (!e) {
            const Clock::time_point t1 = Clock::now();
            e = std::make_shared<const std::vector<float>>(
                config.vision->Encode(image->rgb.data(), image->width, image->height));
            image_metrics.encode_micros += MicrosSince(t1);
            ++image_metrics.encoded;
            encoder_cache->Insert(hash, e);
        }
        if (config.encode_only) {
            // The encode role: published for the consumers the router sends this request to.
            Status saved = config.ec_connector->Save(hash, *e);
            if (!saved.ok()) {
                *bad = {fmt::format("{}: {}", part.param, saved.message()), part.param,
                        "encoder_busy"};
                // Every slot leased is this worker's capacity, not the client's doing: 503 (as
                // docs/disaggregation.md says), not 429.
                if (saved.code() == Code::kResourceExhausted) {
                    return UnavailableError(saved.message());
                }
                return saved.code() == Code::kInvalidArgument ? InternalError(saved.message())
                                                              : saved;
            }
        }
        pr->mm.push_back({static_cast<int>(part.token_offset), image_tokens.tokens_per_image,
                          std::move(hash), std::move(e)});
    }
    pr->images.clear();
    return Status::Ok();
}

void OpenAiServer::Impl::ServeImages(const std::shared_ptr<http::Exchange>& ex, bool chat,
                                     ParsedRequest pr) {
    const std::string* x = ex->request().Find("X-Request-Id");
    const std::string rid = x && ValidRequestId(*x) ? *x : "";
    const auto max_images = size_t(std::max(0, config.media.limits.max_images));
    if (pr.images.size() > max_images) {
        ++image_metrics.refused;
        return ex->Reply(Error(400,
                               {fmt::format("the request has {} images; at most {} are taken "
                                            "per request (--limit-mm-per-prompt)",
                                            pr.images.size(), max_images),
                                "messages", "too_many_images"},
                               rid));
    }
    // The images' URLs are copies of the body's bytes (a data: URL is most of it), kept while
    // the request waits: counted in the body budget with the body itself.
    size_t copies = 0;
    for (const tokenizer::ImagePart& part : pr.images) copies += part.url.size();
    if (!ex->ReserveBody(copies)) {
        ++image_metrics.busy;
        return ex->Reply(Error(503,
                               {"busy: the request bodies this server holds are at their "
                                "budget (--max-inflight-body-mib); retry later",
                                "", "server_busy"},
                               rid));
    }
    if (!config.encoder_urls.empty() && !pr.ec_source && config.ec_connector &&
        !config.encode_only) {
        // Encode workers that timed out are left out until they answer again; with none left
        // the images are encoded here.
        std::vector<http::Endpoint> encoders = encode_step->Answering(config.encoder_urls);
        if (!encoders.empty()) return CallEncoder(ex, chat, std::move(pr), rid, encoders);
    }
    EnqueueImages(ex, chat, std::move(pr), rid);
}

void OpenAiServer::Impl::CallEncoder(const std::shared_ptr<http::Exchange>& ex, bool chat,
                                     ParsedRequest pr, const std::string& rid,
                                     const std::vector<http::Endpoint>& encoders) {
    // SGLang's --encoder-urls: this worker asks an encode worker itself (no router step), as
    // the router would (router/worker_call.h), under the request's id.
    const nlohmann::json body = nlohmann::json::parse(ex->request().body, nullptr, false);
    auto shared = std::make_shared<ParsedRequest>(std::move(pr));
    std::shared_ptr<http::ClientCall> call = encode_step->Call(
        body, encoders, rid.empty() ? RandomId128() : rid,
        [this, ex, chat, rid, shared](router::Encoded e) {
            using Kind = router::Encoded::Kind;
            if (e.kind == Kind::kRefused) {
                // The images themselves are bad: the encode worker's answer names the part.
                ++image_metrics.refused;
                std::vector<http::Header> headers;
                if (!rid.empty()) headers.push_back({"X-Request-Id", rid});
                return ex->Reply(
                    {400, "application/json", std::move(e.refused.body), std::move(headers)});
            }
            if (e.kind == Kind::kEncoded) {
                ++image_metrics.encoder_calls;
                if (!e.ec_transfer_params.empty()) {
                    Result<EcSource> src = ParseEcTransferParams(e.ec_transfer_params);
                    if (src.ok()) shared->ec_source = std::make_shared<const EcSource>(*src);
                }
            } else if (e.kind == Kind::kFailed) {
                // Cancelled: its client left (or the server stops), no failure of the worker's.
                ++image_metrics.encoder_call_failures;
                FERRY_LOG(kWarn, "images: {}; encoding here", e.why);
            }
            EnqueueImages(ex, chat, std::move(*shared), rid);
        });
    // A client that leaves ends the call (the encode worker then drops its work); the request
    // is then dropped from the media queue. Dispatch replaces this once the engine has it.
    if (call) ex->OnClose([call] { call->Cancel(); });
}

void OpenAiServer::Impl::EnqueueImages(const std::shared_ptr<http::Exchange>& ex, bool chat,
                                       ParsedRequest pr, const std::string& rid) {
    auto job = [this, ex, chat, rid, pr = std::move(pr)]() mutable {
        if (stopping) {
            return ex->Reply(Error(503, {"the server is stopping", "", ""}, rid));
        }
        BadRequest bad;
        Status st = EncodeImages(&pr, &bad, ex.get());
        if (st.code() == Code::kCancelled && ex->closed()) {
            ++image_metrics.dropped;  // nobody to answer
            return;
        }
        if (!st.ok()) {
            ++image_metrics.refused;
            return ex->Reply(Error(HttpStatusOf(st), bad, rid));
        }
        if (config.encode_only) return ReplyEncoded(ex, pr, rid);
        Route(ex, chat, std::move(pr));
    };
    if (!media_queue->Post(std::move(job))) {
        ++image_metrics.busy;
        ex->Reply(Error(503,
                        {fmt::format("{} requests with images are waiting for the encoder; "
                                     "retry later",
                                     config.max_pending_image_requests),
                         "", "encoder_busy"},
                        rid));
    }
}

void OpenAiServer::Impl::ReplyEncoded(const std::shared_ptr<http::Exchange>& ex,
                                      const ParsedRequest& pr, const std::string& rid) {
    // As vLLM's encode instance answers the EPD proxy's max_tokens-1 call: a chat.completion
    // (this one has no token: the language model does not run here), which carries where the
    // embeddings wait.
    const std::string base = rid.empty() ? RandomId128() : rid;
    const size_t prompt = pr.prompt.size();
    Json answer = {
        {"id", "chatcmpl-" + base},
        {"object", "chat.completion"},
        {"created", UnixSeconds()},
        {"model", model_name},
        {"choices", Json::array({{{"index", 0},
                                  {"message", {{"role", "assistant"}, {"content", ""}}},
                                  {"logprobs", nullptr},
                                  {"finish_reason", "length"}}})},
        {"usage", {{"prompt_tokens", prompt}, {"completion_tokens", 0}, {"total_tokens", prompt}}}};
    Json params = config.ec_connector->Params();
    if (!params.is_null()) answer["ec_transfer_params"] = std::move(params);
    std::vector<http::Header> headers;
    if (!rid.empty()) headers.push_back({"X-Request-Id", rid});
    ex->Reply({200, "application/json", DumpJson(answer), std::move(headers)});
}

}  // namespace ferry::serve
