#include "engine/engine.h"

#include <fmt/core.h>

#include <algorithm>
#include <optional>
#include <random>

#include "core/log.h"
#include "engine/output_text.h"

namespace ferry::engine {

Result<EngineConfig::KvLoadFailure> ParseKvLoadFailure(std::string_view name) {
    if (name == "fail") return EngineConfig::KvLoadFailure::kFail;
    if (name == "recompute") return EngineConfig::KvLoadFailure::kRecompute;
    return InvalidArgumentError(
        fmt::format("--kv-load-failure '{}' is not one of fail, recompute", name));
}

const char* FinishReasonName(FinishReason r) {
    switch (r) {
        case FinishReason::kNone:
            return "";
        case FinishReason::kStop:
            return "stop";
        case FinishReason::kLength:
            return "length";
        case FinishReason::kAbort:
            return "abort";
        case FinishReason::kError:
            return "error";
    }
    return "";
}

struct Engine::Sequence {
    Request req;
    std::vector<int32_t> tokens;  // prompt, then output
    int prompt_len = 0;
    int num_computed = 0;  // tokens whose KV is in the cache
    std::vector<kv::BlockId> blocks;
    std::vector<BlockHash> hashes;  // of the leading full blocks recorded in the prefix cache
    int cached_tokens = 0;
    int num_output = 0;
    int continued = 0;  // of num_output, those produced elsewhere (Request::continued)
    model::Sampler sampler;
    OutputText text;
    bool aborted = false;
    // Disaggregation: parked (the connector does not allow scheduling yet) or loading remote KV
    // (num_external tokens after num_computed), both in remote_.
    enum class Phase : uint8_t { kLocal, kParked, kLoading } phase = Phase::kLocal;
    int num_external = 0;
    std::optional<kv::FirstToken> first;  // the first token sampled (for RequestFinished)
    // Its KV came from a peer that did not confirm it is this prompt's: it serves this request
    // and never enters the prefix cache (no other request may read it).
    bool no_cache = false;
    // The prompt's multimodal inputs, as the prefix cache's extra keys and the model's inputs.
    std::vector<MmSpan> mm_spans;
    std::vector<model::InputEmbeds> embeds;

    Sequence(Request r, uint64_t seed)
        : req(std::move(r)), sampler(req.sampling, seed), text(req.sampling.stop) {
        tokens = req.prompt;
        for (const MmInput& m : req.mm) {
            mm_spans.push_back({m.offset, m.length, m.hash});
            embeds.push_back({m.offset, m.length, m.embeds->data()});
        }
        prompt_len = static_cast<int>(tokens.size());
        no_cache = req.no_cache;
        tokens.insert(tokens.end(), req.continued.begin(), req.continued.end());
        continued = num_output = static_cast<int>(req.continued.size());
    }
    // Nothing was produced here yet (its output so far, if any, came with it).
    bool NoOutputHere() const { return num_output == continued; }
};

Engine::Engine(std::shared_ptr<model::Model> model, const EngineConfig& config)
    : model_(std::move(model)), config_(config) {}

Result<std::unique_ptr<Engine>> Engine::Create(std::shared_ptr<model::Model> model,
                                               const EngineConfig& config) {
    if (!model) return InvalidArgumentError("engine: no model");
    EngineConfig c = config;
    const model::ModelConfig& mc = model->config();
    if (c.max_model_len <= 0 || c.max_model_len > mc.context_length) {
        c.max_model_len = mc.context_length;
    }
    if (c.max_batched_tokens == 0) {
        c.max_batched_tokens = c.chunked_prefill ? 2048 : std::max(2048, c.max_model_len);
    }
    if (c.block_tokens <= 0 || c.block_tokens > 1024 || c.max_num_seqs <= 0 ||
        c.max_batched_tokens <= 0 || c.max_prefill_chunk < 0) {
        return InvalidArgumentError(fmt::format(
            "engine: block size {}, max seqs {}, max batched tokens {} must be positive",
            c.block_tokens, c.max_num_seqs, c.max_batched_tokens));
    }
    if (!c.chunked_prefill && c.max_batched_tokens < c.max_model_len) {
        return InvalidArgumentError(fmt::format(
            "engine: without chunked prefill, max batched tokens ({}) must be at least the max "
            "model length ({})",
            c.max_batched_tokens, c.max_model_len));
    }
    if (c.num_blocks <= 0) {
        kv::KvCacheSpec one = model->CacheSpec(c.block_tokens, 1, c.kv_dtype);
        uint64_t per_block = one.TotalBytes() * model->cache_ranks();
        c.num_blocks = static_cast<int>(std::min<uint64_t>(c.kv_cache_bytes / per_block, 1u << 24));
        if (c.num_blocks <= 0) {
            return InvalidArgumentError(
                fmt::format("engine: a kv cache of {} bytes holds no block of {} bytes",
                            c.kv_cache_bytes, per_block));
        }
    }
    std::unique_ptr<Engine> e(new Engine(std::move(model), c));
    for (int r = 0; r < e->model_->cache_ranks(); ++r) {
        FERRY_ASSIGN_OR_RETURN(
            auto cache,
            kv::KvCache::Create(e->model_->CacheSpec(c.block_tokens, c.num_blocks, c.kv_dtype),
                                c.allocator));
        e->cache_ptrs_.push_back(cache.get());
        e->caches_.push_back(std::move(cache));
    }
    e->pool_ = std::make_unique<kv::KvBlockPool>(c.num_blocks, c.block_tokens, c.prefix_caching,
                                                 RootBlockHash(c.prefix_hash_seed));
    e->pool_->set_record_events(static_cast<bool>(c.on_kv_events));
    e->counters_.kv_blocks_total = c.num_blocks;
    if (c.connector) {
        Engine* p = e.get();
        FERRY_RETURN_IF_ERROR(c.connector->Bind(e->cache_ptrs_, [p] {
            {
                std::lock_guard lock(p->mu_);
                p->wake_ = true;
            }
            p->cv_.notify_one();
        }));
        e->connector_ = c.connector.get();
    }
    e->PublishStats();
    if (!c.manual_steps) e->thread_ = std::thread([p = e.get()] { p->Loop(); });
    return e;
}

Engine::~Engine() {
    {
        std::lock_guard lock(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    // The connector stops moving bytes into or out of the caches before they go.
    if (connector_) connector_->Unbind();
    // Whatever is left gets its final callback.
    DrainInbox();
    for (auto& s : remote_) {
        if (s->phase == Sequence::Phase::kLoading) {
            s->phase = Sequence::Phase::kLocal;  // unbound: nothing touches its blocks now
        }
        FinishAborted(s.get());
    }
    remote_.clear();
    for (auto& s : running_) FinishAborted(s.get());
    running_.clear();
    for (auto& s : waiting_) FinishAborted(s.get());
    waiting_.clear();
    for (auto& [id, blocks] : held_) pool_->Free(blocks);
    held_.clear();
    PublishStats();
    DeliverFinals();
}

Status Engine::Submit(Request request) {
    const model::ModelConfig& mc = model_->config();
    FERRY_RETURN_IF_ERROR(request.sampling.Validate());
    if (request.prompt.empty()) return InvalidArgumentError("the prompt is empty");
    if (request.kv_transfer) {
        const kv::ConnectorParams& p = *request.kv_transfer;
        if (!connector_) {
            return InvalidArgumentError(
                "kv_transfer_params: this worker has no KV connector (start it with a prefill "
                "or decode role)");
        }
        if (p.prefill_only() && p.loads_kv()) {
            return InvalidArgumentError(
                "kv_transfer_params: a request cannot both prefill for another worker and load "
                "its KV from one");
        }
        // A prefill for a remote decoder produces the first token only.
        if (p.prefill_only()) request.sampling.max_tokens = 1;
    }
    for (int32_t t : request.prompt) {
        if (t < 0 || t >= mc.vocab_size) {
            return InvalidArgumentError(fmt::format(
                "prompt token id {} is outside the vocabulary (0..{})", t, mc.vocab_size - 1));
        }
    }
    int64_t mm_end = 0;
    for (size_t i = 0; i < request.mm.size(); ++i) {
        const MmInput& m = request.mm[i];
        if (m.length <= 0 || m.offset < mm_end ||
            int64_t(m.offset) + m.length > int64_t(request.prompt.size()) || m.hash.empty() ||
            !m.embeds || m.embeds->size() != size_t(m.length) * mc.dim) {
            return InvalidArgumentError(fmt::format(
                "multimodal input {} (tokens {}..{} of a {}-token prompt, {} embedding values "
                "for width {}) does not fit the prompt, overlaps the one before it, or has no "
                "hash",
                i, m.offset, int64_t(m.offset) + m.length, request.prompt.size(),
                m.embeds ? m.embeds->size() : 0, mc.dim));
        }
        mm_end = int64_t(m.offset) + m.length;
    }
    const int64_t want = static_cast<int64_t>(request.prompt.size()) + request.sampling.max_tokens;
    if (want > config_.max_model_len) {
        return InvalidArgumentError(fmt::format(
            "This model's maximum context length is {} tokens. However, you requested {} tokens "
            "({} in the prompt, {} for the completion). Please reduce the prompt or max_tokens.",
            config_.max_model_len, want, request.prompt.size(), request.sampling.max_tokens));
    }
    const int64_t cache_tokens = int64_t(config_.num_blocks) * config_.block_tokens;
    if (want > cache_tokens) {
        return InvalidArgumentError(
            fmt::format("the request needs {} tokens of KV cache but the whole cache holds {}",
                        want, cache_tokens));
    }
    FERRY_RETURN_IF_ERROR(CheckContinued(request));
    static std::atomic<uint64_t> seed_counter{std::random_device{}()};
    auto seq = std::make_unique<Sequence>(std::move(request), seed_counter.fetch_add(0x9e3779b9));
    // The continued tokens as the first worker took them: one draw each, their bytes sent.
    for (size_t i = 0; i < seq->req.continued.size(); ++i) {
        seq->sampler.Skip();
        (void)seq->text.Append(model_->tokenizer().TokenBytes(seq->req.continued[i]));
        (void)seq->text.TakeReady();
    }
    // The connector's caps (holds and loads per client and per peer), outside mu_: the
    // connector calls into the engine (its wake-up) with its own lock held.
    const bool admitted = connector_ && seq->req.kv_transfer;
    if (admitted) FERRY_RETURN_IF_ERROR(connector_->Admit(Conn(seq.get())));
    {
        std::unique_lock lock(mu_);
        Status refused;
        if (stop_) {
            refused = UnavailableError("engine: shutting down");
        } else if (!live_ids_.emplace(seq->req.id, true).second) {
            refused = AlreadyExistsError(fmt::format("request id '{}' is in use", seq->req.id));
        }
        if (!refused.ok()) {
            lock.unlock();
            if (admitted) connector_->Retire(seq->req.id);
            return refused;
        }
        inbox_.push_back(std::move(seq));
        ++stats_.waiting;
    }
    cv_.notify_one();
    return Status::Ok();
}

Status Engine::CheckContinued(const Request& request) const {
    const std::vector<int32_t>& c = request.continued;
    if (c.empty()) return Status::Ok();
    const model::SamplingParams& sp = request.sampling;
    if (request.kv_transfer) {
        return InvalidArgumentError(
            "a continued stream computes its prompt here: it takes no kv_transfer_params");
    }
    if (c.size() >= size_t(sp.max_tokens)) {
        return InvalidArgumentError(fmt::format(
            "{} continued tokens leave nothing of max_tokens {}", c.size(), sp.max_tokens));
    }
    const tokenizer::Tokenizer& tk = model_->tokenizer();
    OutputText text(sp.stop);
    for (int32_t t : c) {
        if (t < 0 || t >= model_->config().vocab_size) {
            return InvalidArgumentError(
                fmt::format("continued token id {} is outside the vocabulary (0..{})", t,
                            model_->config().vocab_size - 1));
        }
        const bool stop_id =
            std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), t) !=
                sp.stop_token_ids.end() ||
            (!sp.ignore_eos &&
             std::find(tk.stop_ids().begin(), tk.stop_ids().end(), t) != tk.stop_ids().end());
        if (stop_id || text.Append(tk.TokenBytes(t))) {
            return InvalidArgumentError(
                "the continued tokens already end the request (a stop token or string)");
        }
    }
    return Status::Ok();
}

bool Engine::IdInUse(const std::string& id) const {
    std::lock_guard lock(mu_);
    return live_ids_.count(id) > 0;
}

void Engine::Abort(const std::string& id, Status reason) {
    {
        std::lock_guard lock(mu_);
        if (!live_ids_.count(id)) return;
        aborts_.emplace_back(id, std::move(reason));
    }
    cv_.notify_one();
}

bool Engine::FlushPrefixCache(std::chrono::milliseconds timeout) {
    auto asked = std::make_shared<std::promise<bool>>();
    std::future<bool> done = asked->get_future();
    {
        std::lock_guard lock(mu_);
        if (stop_) return false;
        flushes_.push_back(asked);
    }
    cv_.notify_one();
    if (done.wait_for(timeout) != std::future_status::ready) return false;
    try {
        return done.get();
    } catch (const std::future_error&) {
        return false;  // the engine stopped first
    }
}

void Engine::DrainInbox() {
    std::vector<std::unique_ptr<Sequence>> inbox;
    std::vector<std::pair<std::string, Status>> aborts;
    std::vector<std::shared_ptr<std::promise<bool>>> flushes;
    {
        std::lock_guard lock(mu_);
        inbox.swap(inbox_);
        aborts.swap(aborts_);
        flushes.swap(flushes_);
    }
    for (auto& asked : flushes) {
        const bool idle = inbox.empty() && running_.empty() && waiting_.empty() && held_.empty();
        if (idle) pool_->ResetCache();
        asked->set_value(idle);
    }
    for (auto& s : inbox) waiting_.push_back(std::move(s));
    for (const auto& abort : aborts) {
        const std::string& id = abort.first;
        const Status& reason = abort.second;
        auto it = std::find_if(running_.begin(), running_.end(),
                               [&](const auto& s) { return s->req.id == id; });
        if (it != running_.end()) {
            FinishAborted(it->get(), reason);
            running_.erase(it);
            continue;
        }
        auto wt = std::find_if(waiting_.begin(), waiting_.end(),
                               [&](const auto& s) { return s->req.id == id; });
        if (wt != waiting_.end()) {
            FinishAborted(wt->get(), reason);
            waiting_.erase(wt);
            continue;
        }
        auto rt = std::find_if(remote_.begin(), remote_.end(),
                               [&](const auto& s) { return s->req.id == id; });
        if (rt != remote_.end()) {
            // Its blocks (if loading) stay held until the connector reports it failed.
            connector_->Abort(id);
            FinishAborted(rt->get(), reason);
            remote_.erase(rt);
        }
    }
}

void Engine::Loop() {
    for (;;) {
        {
            std::unique_lock lock(mu_);
            // After a step that did nothing (everything left waits for remote KV or for blocks
            // that remote transfers hold), only news can change that: a request, an abort, or
            // the connector's wake-up.
            cv_.wait(lock, [&] {
                return stop_ || !inbox_.empty() || !aborts_.empty() || !flushes_.empty() || wake_ ||
                       (progressed_ && (!running_.empty() || !waiting_.empty()));
            });
            if (stop_) return;
            wake_ = false;
        }
        Step();
    }
}

void Engine::RunUntilIdle() {
    while (Step()) {
    }
}

void Engine::Preempt(Sequence* s) {
    pool_->Free(s->blocks);
    s->blocks.clear();
    s->hashes.clear();
    s->num_computed = 0;
    ++counters_.preemptions;
}

void Engine::Schedule(std::vector<std::pair<Sequence*, int>>* plan) {
    const int bt = config_.block_tokens;
    int budget = config_.max_batched_tokens;
    auto limit_chunk = [&](int n) {
        if (config_.max_prefill_chunk > 0 && n > 1) n = std::min(n, config_.max_prefill_chunk);
        return std::min(n, budget);
    };
    auto blocks_needed = [&](const Sequence& s, int n) {
        int total = (s.num_computed + n + bt - 1) / bt;
        return std::max(0, total - static_cast<int>(s.blocks.size()));
    };

    // Running sequences first, oldest first; when blocks run out, the newest one goes back to
    // waiting (recomputed later).
    bool preempted = false;
    size_t i = 0;
    while (i < running_.size() && budget > 0) {
        Sequence* s = running_[i].get();
        int n = limit_chunk(static_cast<int>(s->tokens.size()) - s->num_computed);
        int need = blocks_needed(*s, n);
        bool self_preempted = false;
        while (pool_->num_free() < need) {
            std::unique_ptr<Sequence> victim = std::move(running_.back());
            running_.pop_back();
            Preempt(victim.get());
            preempted = true;
            bool self = victim.get() == s;
            waiting_.push_front(std::move(victim));
            if (self) {
                self_preempted = true;
                break;
            }
        }
        if (self_preempted) break;
        auto fresh = pool_->Allocate(need);
        s->blocks.insert(s->blocks.end(), fresh->begin(), fresh->end());
        plan->emplace_back(s, n);
        budget -= n;
        ++i;
    }
    if (preempted) return;

    // Then waiting ones, first come first served.
    while (!waiting_.empty() && budget > 0 &&
           static_cast<int>(running_.size()) < config_.max_num_seqs) {
        Sequence* s = waiting_.front().get();
        const int len = static_cast<int>(s->tokens.size());
        // A request with kv params asks the connector, once (a preempted one recomputes here).
        const bool remote_kv = connector_ && s->req.kv_transfer && s->num_output == 0;
        if (remote_kv && !connector_->ReadyToSchedule(Conn(s))) {
            s->phase = Sequence::Phase::kParked;
            remote_.push_back(std::move(waiting_.front()));
            waiting_.pop_front();
            continue;
        }
        // Start from the longest cached prefix; at least the last token is computed, to have
        // its logits. Waiting sequences hold no blocks: on failure the prefix goes back.
        std::vector<BlockHash> hashes;
        s->blocks = pool_->AcquireCachedPrefix(std::span(s->tokens).first(len - 1), SIZE_MAX,
                                               &hashes, s->mm_spans);
        s->hashes = std::move(hashes);
        s->num_computed = static_cast<int>(s->blocks.size()) * bt;
        const int external = remote_kv
                                 ? std::min(connector_->ExternalTokens(Conn(s), s->num_computed),
                                            len - s->num_computed)
                                 : 0;
        if (external > 0) {
            // Blocks for the tokens that arrive; the sequence waits for them off the batch.
            int need = blocks_needed(*s, external);
            if (pool_->num_free() < need) {
                pool_->Free(s->blocks);
                s->blocks.clear();
                s->hashes.clear();
                s->num_computed = 0;
                break;
            }
            s->cached_tokens = s->num_computed;
            counters_.prefix_query_tokens += len;
            counters_.prefix_hit_tokens += s->num_computed;
            auto fresh = pool_->Allocate(need);
            s->blocks.insert(s->blocks.end(), fresh->begin(), fresh->end());
            s->phase = Sequence::Phase::kLoading;
            s->num_external = external;
            connector_->StartLoad(Conn(s), s->blocks, s->num_computed, external);
            remote_.push_back(std::move(waiting_.front()));
            waiting_.pop_front();
            continue;
        }
        int remaining = len - s->num_computed;
        int n = limit_chunk(remaining);
        int need = blocks_needed(*s, n);
        if ((!config_.chunked_prefill && remaining > budget) || pool_->num_free() < need) {
            pool_->Free(s->blocks);
            s->blocks.clear();
            s->hashes.clear();
            s->num_computed = 0;
            break;
        }
        if (s->NoOutputHere()) s->cached_tokens = s->num_computed;
        counters_.prefix_query_tokens += len;
        counters_.prefix_hit_tokens += s->num_computed;
        auto fresh = pool_->Allocate(need);
        s->blocks.insert(s->blocks.end(), fresh->begin(), fresh->end());
        plan->emplace_back(s, n);
        budget -= n;
        running_.push_back(std::move(waiting_.front()));
        waiting_.pop_front();
    }
}

bool Engine::Step() {
    bool more = StepBatch();
    if (config_.on_kv_events) {
        std::vector<schema::KvCacheEvent> events = pool_->TakeEvents();
        if (!events.empty()) config_.on_kv_events(std::move(events));
    }
    PublishStats();
    DeliverFinals();
    return more;
}

bool Engine::StepBatch() {
    DrainInbox();
    progressed_ = connector_ && HandleConnectorEvents();
    if (running_.empty() && waiting_.empty()) {
        return !remote_.empty();
    }
    std::vector<std::pair<Sequence*, int>> plan;
    const uint64_t preemptions = counters_.preemptions;
    const size_t parked = remote_.size();
    Schedule(&plan);
    progressed_ = progressed_ || !plan.empty() || counters_.preemptions != preemptions ||
                  remote_.size() != parked;
    if (plan.empty()) return true;  // after preempting everything the next step admits

    std::vector<model::SeqChunk> chunks;
    chunks.reserve(plan.size());
    int num_logits = 0;
    for (auto [s, n] : plan) {
        model::SeqChunk c;
        c.tokens = std::span(s->tokens).subspan(s->num_computed, n);
        c.start_pos = s->num_computed;
        c.block_table = s->blocks;
        c.want_logits = s->num_computed + n == static_cast<int>(s->tokens.size());
        c.embeds = s->embeds;
        num_logits += c.want_logits;
        chunks.push_back(c);
    }
    logits_.resize(size_t(std::max(num_logits, 1)) * model_->config().vocab_size);
    kv::LayerHook* hook = nullptr;
    bool began = false;
    if (connector_) {
        std::vector<kv::StepChunk> kc;
        for (size_t k = 0; k < plan.size(); ++k) {
            Sequence* s = plan[k].first;
            if (!s->req.kv_transfer || s->num_output > 0) continue;
            kc.push_back({&s->req.id, s->req.kv_transfer.get(), s->blocks, s->num_computed,
                          plan[k].second, chunks[k].want_logits});
        }
        if (!kc.empty()) {
            hook = connector_->BeginStep(kc);
            began = true;
        }
    }
    Status st = model_->Forward(chunks, cache_ptrs_, logits_.data(), hook);
    if (began) connector_->EndStep();
    ++counters_.steps;

    std::vector<Sequence*> finished;
    int li = 0;
    for (size_t k = 0; k < plan.size(); ++k) {
        auto [s, n] = plan[k];
        RequestOutput out;
        if (!st.ok()) {
            out.error = st;
            Finish(s, FinishReason::kError, &out);
            finished.push_back(s);
            continue;
        }
        s->num_computed += n;
        if (s->NoOutputHere()) counters_.prompt_tokens += n;
        CommitFullBlocks(s);
        if (!chunks[k].want_logits) continue;
        const float* row = &logits_[size_t(li++) * model_->config().vocab_size];
        model::SampledToken tok = s->sampler.Sample(row, model_->config().vocab_size);
        ProcessToken(s, tok, &out);
        if (out.finish != FinishReason::kNone) finished.push_back(s);
    }
    for (Sequence* s : finished) {
        auto it = std::find_if(running_.begin(), running_.end(),
                               [&](const auto& p) { return p.get() == s; });
        if (it != running_.end()) running_.erase(it);
    }
    return true;
}

void Engine::CommitFullBlocks(Sequence* s) {
    if (!config_.prefix_caching || s->no_cache) return;
    const int bt = config_.block_tokens;
    while (static_cast<int>(s->hashes.size() + 1) * bt <= s->num_computed) {
        size_t b = s->hashes.size();
        const BlockHash parent = b == 0 ? pool_->root() : s->hashes.back();
        auto toks = std::span(s->tokens).subspan(b * bt, bt);
        const int64_t start = int64_t(b) * bt;
        const BlockHash h =
            HashBlockTokens(parent, toks, MmExtraKeys(s->mm_spans, start, start + bt));
        pool_->Cache(s->blocks[b], h, parent, toks);
        s->hashes.push_back(h);
    }
}

void Engine::ProcessToken(Sequence* s, const model::SampledToken& tok, RequestOutput* out) {
    const tokenizer::Tokenizer& tk = model_->tokenizer();
    const model::SamplingParams& sp = s->req.sampling;
    s->tokens.push_back(tok.token);
    ++s->num_output;
    ++counters_.generation_tokens;
    if (s->num_output == 1 && s->req.kv_transfer) {
        s->first = kv::FirstToken{tok.token, tok.logprob, tok.top};
    }
    out->tokens.push_back(tok.token);
    if (sp.logprobs >= 0) {
        out->logprobs.push_back(tok.logprob);
        out->top_logprobs.push_back(tok.top);
    }
    bool stop_token = std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), tok.token) !=
                      sp.stop_token_ids.end();
    if (!sp.ignore_eos) {
        const auto& ids = tk.stop_ids();
        stop_token = stop_token || std::find(ids.begin(), ids.end(), tok.token) != ids.end();
    }
    if (stop_token) {
        Finish(s, FinishReason::kStop, out);
        return;
    }
    if (s->text.Append(tk.TokenBytes(tok.token))) {
        Finish(s, FinishReason::kStop, out);
        return;
    }
    if (s->num_output >= sp.max_tokens ||
        static_cast<int>(s->tokens.size()) >= config_.max_model_len) {
        Finish(s, FinishReason::kLength, out);
        return;
    }
    out->text = s->text.TakeReady();
    out->prompt_tokens = s->prompt_len;
    out->completion_tokens = s->num_output;
    out->cached_tokens = s->cached_tokens;
    out->external_tokens = s->num_external;
    s->req.on_output(*out);
}

void Engine::Finish(Sequence* s, FinishReason reason, RequestOutput* out) {
    out->text += s->text.TakeRest();
    out->finish = reason;
    out->prompt_tokens = s->prompt_len;
    out->completion_tokens = s->num_output;
    out->cached_tokens = s->cached_tokens;
    out->external_tokens = s->num_external;
    const bool ok = reason == FinishReason::kStop || reason == FinishReason::kLength;
    ReleaseBlocks(s, ok, out);
    if (connector_ && s->req.kv_transfer) connector_->Retire(s->req.id);
    ++counters_.requests_finished;
    if (!held_.count(s->req.id)) {
        std::lock_guard lock(mu_);
        live_ids_.erase(s->req.id);
    }
    if (s->req.on_output) finals_.emplace_back(std::move(s->req.on_output), *out);
}

void Engine::ReleaseBlocks(Sequence* s, bool ok, RequestOutput* out) {
    if (s->phase == Sequence::Phase::kLoading) {
        // Remote KV may still be arriving: the connector reports when it no longer is.
        held_[s->req.id] = std::move(s->blocks);
        s->blocks.clear();
        return;
    }
    if (connector_ && s->req.kv_transfer) {
        kv::FinishAction a =
            connector_->RequestFinished(Conn(s), s->blocks, ok, s->first ? &*s->first : nullptr);
        out->kv_transfer = std::move(a.params);
        if (!a.refused.ok()) {
            out->finish = FinishReason::kError;
            out->error = std::move(a.refused);
        }
        if (a.hold_blocks) {
            held_[s->req.id] = std::move(s->blocks);
            s->blocks.clear();
            return;
        }
    }
    pool_->Free(s->blocks);
    s->blocks.clear();
}

void Engine::FreeHeld(const std::string& id) {
    auto it = held_.find(id);
    if (it == held_.end()) return;
    pool_->Free(it->second);
    held_.erase(it);
    std::lock_guard lock(mu_);
    live_ids_.erase(id);
}

bool Engine::HandleConnectorEvents() {
    std::vector<kv::ConnectorEvent> events = connector_->TakeEvents();
    for (kv::ConnectorEvent& ev : events) {
        auto it = std::find_if(remote_.begin(), remote_.end(),
                               [&](const auto& s) { return s->req.id == ev.id; });
        if (it == remote_.end()) {
            // Blocks of an ended request: free once nothing touches them any more.
            if (ev.kind != kv::ConnectorEvent::Kind::kReady) FreeHeld(ev.id);
            continue;
        }
        Sequence* s = it->get();
        using Kind = kv::ConnectorEvent::Kind;
        if (ev.kind == Kind::kFailed && s->phase == Sequence::Phase::kLoading &&
            config_.kv_load_failure == EngineConfig::KvLoadFailure::kRecompute) {
            // The load's blocks are the connector's no longer: they go back (the cached prefix
            // is found again when it is scheduled), and the request is a plain one from now on.
            ++counters_.kv_load_failures;
            ++counters_.kv_load_recomputed;
            FERRY_LOG(kInfo, "engine: request {}: its KV did not arrive ({}); computing it here",
                      s->req.id, ev.status.message());
            pool_->Free(s->blocks);
            s->blocks.clear();
            s->hashes.clear();
            s->num_computed = 0;
            s->num_external = 0;
            s->cached_tokens = 0;
            s->phase = Sequence::Phase::kLocal;
            connector_->Retire(s->req.id);
            s->req.kv_transfer = nullptr;
            waiting_.push_front(std::move(*it));
            remote_.erase(it);
            continue;
        }
        if (ev.kind == Kind::kFailed) {
            ++counters_.kv_load_failures;
            s->phase = Sequence::Phase::kLocal;  // the connector is done with its blocks
            RequestOutput out;
            out.error = ev.status;
            Finish(s, FinishReason::kError, &out);
            remote_.erase(it);
            continue;
        }
        if (ev.kind == Kind::kReady && s->phase == Sequence::Phase::kParked) {
            s->phase = Sequence::Phase::kLocal;
            waiting_.push_back(std::move(*it));
            remote_.erase(it);
            continue;
        }
        if (ev.kind != Kind::kLoaded || s->phase != Sequence::Phase::kLoading) continue;
        s->phase = Sequence::Phase::kLocal;
        s->num_computed += s->num_external;
        counters_.kv_external_tokens += s->num_external;
        if (!ev.cacheable) s->no_cache = true;
        CommitFullBlocks(s);
        std::unique_ptr<Sequence> owned = std::move(*it);
        remote_.erase(it);
        if (ev.first_token && s->num_computed == static_cast<int>(s->tokens.size())) {
            // The sender sampled the first token: continue from it, as if sampled here.
            model::SampledToken tok{ev.first_token->token, ev.first_token->logprob,
                                    std::move(ev.first_token->top)};
            s->sampler.Skip();
            RequestOutput out;
            ProcessToken(s, tok, &out);
            if (out.finish != FinishReason::kNone) continue;  // finished (owned goes)
        }
        running_.push_back(std::move(owned));
    }
    return !events.empty();
}

void Engine::FinishAborted(Sequence* s, Status reason) {
    RequestOutput out;  // its own: an aborted request's final output carries only its held text
    if (!reason.ok()) {
        out.error = std::move(reason);
        Finish(s, FinishReason::kError, &out);
        return;
    }
    Finish(s, FinishReason::kAbort, &out);
}

void Engine::DeliverFinals() {
    std::vector<std::pair<OutputCallback, RequestOutput>> finals;
    finals.swap(finals_);
    for (auto& [callback, out] : finals) callback(out);
}

kv::ConnectorRequest Engine::Conn(const Sequence* s) const {
    return {s->req.id, std::span(s->tokens).first(s->prompt_len), *s->req.kv_transfer, s->mm_spans};
}

void Engine::PublishStats() {
    counters_.running = static_cast<int>(running_.size());
    counters_.kv_blocks_used = pool_->num_used();
    counters_.kv_parked = counters_.kv_loading = 0;
    for (const auto& s : remote_) {
        (s->phase == Sequence::Phase::kParked ? counters_.kv_parked : counters_.kv_loading)++;
    }
    counters_.kv_held = static_cast<int>(held_.size());
    std::lock_guard lock(mu_);
    int waiting = static_cast<int>(waiting_.size() + inbox_.size());
    stats_ = counters_;
    stats_.waiting = waiting;
}

EngineStats Engine::Stats() const {
    std::lock_guard lock(mu_);
    return stats_;
}

}  // namespace ferry::engine
