#include "serve/image_pipeline.h"

#include "core/clock.h"
#include "core/json_fields.h"
#include "serve/openai_server_parts.h"

namespace ferry::serve {

using namespace server_parts;  // NOLINT(build/namespaces): the server's own parts

Result<std::unique_ptr<ImagePipeline>> ImagePipeline::Create(OpenAiServer::Impl& server) {
    const ServerConfig& config = server.config;
    const model::VisionConfig& vc = config.vision->config();
    const int dim = server.engine->model().config().dim;
    if (vc.out_dim != dim) {
        return InvalidArgumentError(fmt::format(
            "serve: the vision encoder projects to width {}, the model's embeddings are {} "
            "wide (a projector for another model?)",
            vc.out_dim, dim));
    }
    if (vc.tokens_per_image() >= server.engine->max_model_len()) {
        return InvalidArgumentError(
            fmt::format("serve: an image takes {} tokens, the context only {}",
                        vc.tokens_per_image(), server.engine->max_model_len()));
    }
    if (config.max_pending_image_requests < 1) {
        return InvalidArgumentError("serve: max pending image requests must be at least 1");
    }
    std::unique_ptr<ImagePipeline> p(new ImagePipeline(server));
    p->tokens_ = {vc.tokens_per_image(),
                  tokenizer::ImagePlaceholder(server.engine->model().tokenizer())};
    FERRY_ASSIGN_OR_RETURN(p->cache_,
                           media::EncoderCache::Open(
                               config.encoder_cache_bytes,
                               {.dir = config.encoder_cache_dir,
                                .capacity_bytes = config.encoder_cache_disk_bytes,
                                .encoder = config.vision->fingerprint(),
                                .entry_floats = size_t(vc.tokens_per_image()) * size_t(vc.out_dim),
                                .width = size_t(vc.out_dim)}));
    p->queue_ = std::make_unique<MediaQueue>(size_t(config.max_pending_image_requests));
    if (config.ec_connector && !config.encode_only && config.ec_renew_interval.count() > 0) {
        p->renewals_ = std::make_unique<EcRenewals>(config.ec_connector, config.ec_renew_interval);
    }
    p->encode_step_ = std::make_unique<router::EncodeStep>(
        router::EncodeStepConfig{config.router_token, config.encoder_timeout}, server.client.get(),
        server.quarantine.get());
    return p;
}

Status ImagePipeline::Encode(ParsedRequest* pr, BadRequest* bad, const http::Exchange* ex) {
    for (tokenizer::ImagePart& part : pr->images) {
        // A client that left is not worked for: checked before each image (one image's decoding
        // and encoding is the most it still costs).
        if (ex && ex->closed()) return CancelledError("the client went away");
        const Clock::time_point t0 = Clock::now();
        Result<media::Image> image = [&]() -> Result<media::Image> {
            FERRY_ASSIGN_OR_RETURN(std::string bytes,
                                   media::ReadImageUrl(part.url, m_.config.media));
            part.url.clear();  // a data: URL's copy of the bytes goes now
            part.url.shrink_to_fit();
            return media::DecodeImage(bytes, m_.config.media.limits);
        }();
        if (!image.ok()) {
            *bad = {fmt::format("{}: {}", part.param, image.status().message()),
                    part.param + ".url", "invalid_image"};
            return image.status();
        }
        ++metrics_.images;
        metrics_.decode_micros += MicrosSince(t0);
        std::string hash = image->HashHex();
        media::Embeddings e = cache_->Find(hash);
        const size_t floats =
            size_t(tokens_.tokens_per_image) * size_t(m_.config.vision->config().out_dim);
        if (e && pr->ec_source && m_.config.ec_connector && !m_.config.encode_only) {
            // Cached here: the encode worker's entry for this request is not needed.
            m_.config.ec_connector->Release(hash, pr->ec_source.get());
        }
        if (!e && m_.config.ec_connector && !m_.config.encode_only) {
            // EPD: an encode worker computed it (or the shared directory holds it).
            Result<media::Embeddings> got =
                m_.config.ec_connector->Load(hash, floats, pr->ec_source.get());
            if (got.ok()) {
                e = std::move(*got);
                if (m_.config.ec_connector->Cacheable()) {
                    cache_->Insert(hash, e);
                } else {
                    pr->no_cache = true;  // this request's alone
                }
            } else if (got.status().code() != Code::kNotFound || pr->ec_source ||
                       m_.config.ec_connector->FindsWithoutParams()) {
                // Expected there and not found, or the producer failed.
                if (m_.config.ec_load_failure == EcLoadFailure::kFail) {
                    *bad = {fmt::format("{}: its embeddings could not be loaded "
                                        "(--ec-load-failure fail): {}",
                                        part.param, got.status().message()),
                            part.param, "ec_load_failed"};
                    return UnavailableError(got.status().message());  // 503
                }
                FERRY_LOG(kInfo, "images: {}: encoding here: {}", part.param,
                          got.status().message());
                ++metrics_.ec_fallbacks;
            }
        }
        if (!e) {
            const Clock::time_point t1 = Clock::now();
            e = std::make_shared<const std::vector<float>>(
                m_.config.vision->Encode(image->rgb.data(), image->width, image->height));
            metrics_.encode_micros += MicrosSince(t1);
            ++metrics_.encoded;
            cache_->Insert(hash, e);
        }
        if (m_.config.encode_only) {
            // The encode role: published for the consumers the router sends this request to.
            Status saved = m_.config.ec_connector->Save(hash, *e);
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
        pr->mm.push_back({static_cast<int>(part.token_offset), tokens_.tokens_per_image,
                          std::move(hash), std::move(e)});
    }
    pr->images.clear();
    return Status::Ok();
}

void ImagePipeline::Serve(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr) {
    const std::string* x = ex->request().Find("X-Request-Id");
    const std::string rid = x && ValidRequestId(*x) ? *x : "";
    const auto max_images = size_t(std::max(0, m_.config.media.limits.max_images));
    if (pr.images.size() > max_images) {
        ++metrics_.refused;
        return ex->Reply(m_.Error(400,
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
        ++metrics_.busy;
        return ex->Reply(m_.Error(503,
                                  {"busy: the request bodies this server holds are at their "
                                   "budget (--max-inflight-body-mib); retry later",
                                   "", "server_busy"},
                                  rid));
    }
    if (!m_.config.encoder_urls.empty() && !pr.ec_source && m_.config.ec_connector &&
        !m_.config.encode_only) {
        // Encode workers that timed out are left out until they answer again; with none left
        // the images are encoded here.
        std::vector<http::Endpoint> encoders = encode_step_->Answering(m_.config.encoder_urls);
        if (!encoders.empty()) return CallEncoder(ex, chat, std::move(pr), rid, encoders);
    }
    Enqueue(ex, chat, std::move(pr), rid);
}

void ImagePipeline::CallEncoder(const std::shared_ptr<http::Exchange>& ex, bool chat,
                                ParsedRequest pr, const std::string& rid,
                                const std::vector<http::Endpoint>& encoders) {
    // SGLang's --encoder-urls: this worker asks an encode worker itself (no router step), as
    // the router would (router/worker_call.h), under the request's id.
    const nlohmann::json body = nlohmann::json::parse(ex->request().body, nullptr, false);
    auto shared = std::make_shared<ParsedRequest>(std::move(pr));
    std::shared_ptr<http::ClientCall> call = encode_step_->Call(
        body, encoders, rid.empty() ? RandomId128() : rid,
        [this, ex, chat, rid, shared](router::Encoded e) {
            using Kind = router::Encoded::Kind;
            if (e.kind == Kind::kRefused) {
                // The images themselves are bad: the encode worker's answer names the part.
                ++metrics_.refused;
                std::vector<http::Header> headers;
                if (!rid.empty()) headers.push_back({"X-Request-Id", rid});
                return ex->Reply(
                    {400, "application/json", std::move(e.refused.body), std::move(headers)});
            }
            if (e.kind == Kind::kEncoded) {
                ++metrics_.encoder_calls;
                if (!e.ec_transfer_params.empty()) {
                    Result<EcSource> src = schema::ParseEcTransferParams(e.ec_transfer_params);
                    if (src.ok()) shared->ec_source = std::make_shared<const EcSource>(*src);
                }
            } else if (e.kind == Kind::kFailed) {
                // Cancelled: its client left (or the server stops), no failure of the worker's.
                ++metrics_.encoder_call_failures;
                FERRY_LOG(kWarn, "images: {}; encoding here", e.why);
            }
            Enqueue(ex, chat, std::move(*shared), rid);
        });
    // A client that leaves ends the call (the encode worker then drops its work); the request
    // is then dropped from the media queue. Dispatch replaces this once the engine has it.
    if (call) ex->OnClose([call] { call->Cancel(); });
}

void ImagePipeline::Enqueue(const std::shared_ptr<http::Exchange>& ex, bool chat, ParsedRequest pr,
                            const std::string& rid) {
    // Its encode worker's entries are kept for it while it waits (and no longer).
    const uint64_t renewal = renewals_ && pr.ec_source && !pr.ec_source->mm_hashes.empty()
                                 ? renewals_->Waiting(pr.ec_source)
                                 : 0;
    auto job = [this, ex, chat, rid, renewal, pr = std::move(pr)]() mutable {
        if (renewal) renewals_->Done(renewal);
        if (m_.stopping) {
            return ex->Reply(m_.Error(503, {"the server is stopping", "", ""}, rid));
        }
        BadRequest bad;
        Status st = Encode(&pr, &bad, ex.get());
        if (st.code() == Code::kCancelled && ex->closed()) {
            ++metrics_.dropped;  // nobody to answer
            return;
        }
        if (!st.ok()) {
            ++metrics_.refused;
            return ex->Reply(m_.Error(HttpStatusOf(st), bad, rid));
        }
        if (m_.config.encode_only) return ReplyEncoded(ex, pr, rid);
        m_.Route(ex, chat, std::move(pr));
    };
    if (!queue_->Post(std::move(job))) {
        if (renewal) renewals_->Done(renewal);
        ++metrics_.busy;
        ex->Reply(m_.Error(503,
                           {fmt::format("{} requests with images are waiting for the encoder; "
                                        "retry later",
                                        m_.config.max_pending_image_requests),
                            "", "encoder_busy"},
                           rid));
    }
}

void ImagePipeline::ReplyEncoded(const std::shared_ptr<http::Exchange>& ex, const ParsedRequest& pr,
                                 const std::string& rid) {
    // As vLLM's encode instance answers the EPD proxy's max_tokens-1 call: a chat.completion
    // (this one has no token: the language model does not run here), which carries where the
    // embeddings wait.
    const std::string base = rid.empty() ? RandomId128() : rid;
    const size_t prompt = pr.prompt.size();
    Json answer = {
        {"id", "chatcmpl-" + base},
        {"object", "chat.completion"},
        {"created", UnixSeconds()},
        {"model", m_.model_name},
        {"choices", Json::array({{{"index", 0},
                                  {"message", {{"role", "assistant"}, {"content", ""}}},
                                  {"logprobs", nullptr},
                                  {"finish_reason", "length"}}})},
        {"usage", {{"prompt_tokens", prompt}, {"completion_tokens", 0}, {"total_tokens", prompt}}}};
    Json params = m_.config.ec_connector->Params();
    if (!params.is_null()) {
        // The entries this request's consumers will load, so that they can renew their
        // leases while they wait.
        Json hashes = Json::array();
        for (const engine::MmInput& m : pr.mm) {
            if (hashes.size() < schema::kMaxEcHashes) hashes.push_back(m.hash);
        }
        if (!hashes.empty()) params["mm_hashes"] = std::move(hashes);
        answer["ec_transfer_params"] = std::move(params);
    }
    std::vector<http::Header> headers;
    if (!rid.empty()) headers.push_back({"X-Request-Id", rid});
    ex->Reply({200, "application/json", DumpJson(answer), std::move(headers)});
}

EcRenewals::~EcRenewals() {
    {
        std::lock_guard lock(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
}

uint64_t EcRenewals::Waiting(std::shared_ptr<const EcSource> source) {
    ec_->Renew(*source, 3 * every_);  // at once: a first lease may be nearly over
    std::lock_guard lock(mu_);
    const uint64_t id = next_id_++;
    waiting_[id] = {std::move(source), std::chrono::steady_clock::now() + every_};
    if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
    return id;
}

void EcRenewals::Done(uint64_t id) {
    std::lock_guard lock(mu_);
    waiting_.erase(id);
}

void EcRenewals::Run() {
    std::unique_lock lock(mu_);
    while (!stop_) {
        cv_.wait_for(lock,
                     std::min<std::chrono::milliseconds>(every_ / 4 + std::chrono::milliseconds(1),
                                                         std::chrono::milliseconds(250)));
        const auto now = std::chrono::steady_clock::now();
        std::vector<std::shared_ptr<const EcSource>> due;
        for (auto& [id, e] : waiting_) {
            if (now < e.next) continue;
            e.next = now + every_;
            due.push_back(e.source);
        }
        lock.unlock();
        for (const auto& src : due) ec_->Renew(*src, 3 * every_);  // not waited for
        lock.lock();
    }
}

}  // namespace ferry::serve
