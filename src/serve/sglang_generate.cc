// SGLang's own routes on a ferry worker: POST /generate (its native API, one prompt or a batch,
// streamed or whole, with SGLang's PD fields), and what its mini_lb calls on each worker:
// /health_generate, /get_server_info, /get_model_info, /flush_cache. The shapes are SGLang's
// (sglang/srt/entrypoints/http_server.py, managers/io_struct.py); docs/coming-from.md.
#include "core/json_fields.h"
#include "serve/openai_server_parts.h"
#include "serve/sglang_pd.h"

namespace ferry::serve {

using namespace server_parts;  // NOLINT(build/namespaces): the server's own parts

namespace {

// One prompt of a /generate request, as it goes.
struct GenItem {
    std::string id;  // the engine's
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;
    std::vector<std::vector<std::pair<int32_t, float>>> tops;
    std::string text;
    engine::FinishReason finish = engine::FinishReason::kNone;
    Status error;
    int prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
    int32_t last = -1;
};

struct GenState {
    std::mutex mu;
    std::vector<GenItem> items;
    size_t done = 0;
    bool answered = false;
    Clock::time_point start = Clock::now();
};

}  // namespace

void OpenAiServer::Impl::Generate(const std::shared_ptr<http::Exchange>& ex) {
    const tokenizer::Tokenizer& tk = engine->model().tokenizer();
    const std::string* x = ex->request().Find("X-Request-Id");
    const std::string rid_header = x && ValidRequestId(*x) ? *x : "";
    auto g = std::make_shared<GenerateRequest>();
    BadRequest bad;
    if (!ParseGenerateRequest(ex->request().body, tk, engine->max_model_len(), g.get(), &bad)) {
        return ex->Reply(Error(400, bad, rid_header));
    }
    const size_t n = g->items.size();
    // Then into the engine, every prompt at once.
    auto run = [this, ex, g, rid_header]() {
        for (ParsedRequest& pr : g->items) {
            if (auto refused = TakeKvParams(*ex, &pr)) return ex->Reply(*refused);
        }
        const tokenizer::Tokenizer& tk = engine->model().tokenizer();
        const size_t n = g->items.size();
        auto st = std::make_shared<GenState>();
        st->items.resize(n);
        const std::string base = rid_header.empty() ? RandomId128() : rid_header;
        for (size_t i = 0; i < n; ++i) {
            std::string id = !g->rids[i].empty() ? g->rids[i]
                             : n == 1            ? base
                                                 : fmt::format("{}-{}", base, i);
            if (engine->IdInUse(id)) id += "-" + RandomId128().substr(0, 8);
            st->items[i].id = id;
        }
        const bool text_in_lp = g->return_text_in_logprobs;
        const bool batch = g->batch, stream = g->stream, want_lp = g->return_logprob;
        const int top_n = g->top_logprobs_num;
        // One prompt's answer as SGLang writes it (a stream's chunk carries all so far).
        auto item_json = [&tk, text_in_lp, want_lp, top_n, batch, stream](
                             const GenItem& it, size_t i, double seconds) {
            auto entry = [&](float lp, int32_t t) {
                return Json::array({lp, t, text_in_lp ? Json(tk.token_text(t)) : Json()});
            };
            Json finish;
            switch (it.finish) {
                case engine::FinishReason::kLength:
                    finish = {{"type", "length"}, {"length", it.completion_tokens}};
                    break;
                case engine::FinishReason::kStop:
                    finish = {{"type", "stop"}, {"matched", it.last}};
                    break;
                case engine::FinishReason::kAbort:
                case engine::FinishReason::kError:
                    finish = {{"type", "abort"}, {"message", it.error.message()}};
                    break;
                default:
                    break;
            }
            Json meta = {{"id", it.id},
                         {"finish_reason", finish},
                         {"prompt_tokens", it.prompt_tokens},
                         {"completion_tokens", it.completion_tokens},
                         {"cached_tokens", it.cached_tokens},
                         {"e2e_latency", seconds}};
            if (want_lp) {
                Json out = Json::array();
                for (size_t k = 0; k < it.tokens.size() && k < it.logprobs.size(); ++k) {
                    out.push_back(entry(it.logprobs[k], it.tokens[k]));
                }
                // Prompt log-probabilities are not computed here (logprob_start_len -1, as
                // SGLang's default): none, which mini_lb's merge takes as it is.
                meta["input_token_logprobs"] = Json::array();
                meta["output_token_logprobs"] = out;
                if (top_n > 0) {
                    Json tops = Json::array();
                    for (const auto& t : it.tops) {
                        Json one = Json::array();
                        for (auto [id, lp] : t) one.push_back(entry(lp, id));
                        tops.push_back(one);
                    }
                    meta["input_top_logprobs"] = Json::array();
                    meta["output_top_logprobs"] = tops;
                }
            }
            Json j = {{"text", it.text}, {"output_ids", it.tokens}, {"meta_info", meta}};
            if (batch && stream) j["index"] = i;
            return j;
        };
        if (stream) ex->StartStream(200, "text/event-stream", {{"Cache-Control", "no-cache"}});
        std::weak_ptr<http::Exchange> weak = ex;
        for (size_t i = 0; i < n; ++i) {
            engine::Request er;
            er.id = st->items[i].id;
            er.prompt = g->items[i].prompt;
            er.sampling = g->items[i].sampling;
            er.kv_transfer = g->items[i].kv_transfer;
            er.on_output = [this, st, weak, i, stream, batch, item_json,
                            base](const engine::RequestOutput& o) {
                std::shared_ptr<http::Exchange> ex = weak.lock();
                std::unique_lock lock(st->mu);
                GenItem& it = st->items[i];
                it.tokens.insert(it.tokens.end(), o.tokens.begin(), o.tokens.end());
                it.logprobs.insert(it.logprobs.end(), o.logprobs.begin(), o.logprobs.end());
                it.tops.insert(it.tops.end(), o.top_logprobs.begin(), o.top_logprobs.end());
                it.text += o.text;
                if (!o.tokens.empty()) it.last = o.tokens.back();
                it.prompt_tokens = o.prompt_tokens;
                it.completion_tokens = o.completion_tokens;
                it.cached_tokens = o.cached_tokens;
                const bool final = o.finish != engine::FinishReason::kNone;
                if (final) {
                    it.finish = o.finish;
                    it.error = o.error;
                    ++st->done;
                    std::lock_guard m(metrics.mu);
                    ++metrics.finished[engine::FinishReasonName(o.finish)];
                }
                if (!ex || ex->closed() || st->answered) return;
                const double secs = std::chrono::duration<double>(Clock::now() - st->start).count();
                if (stream) {
                    std::string bytes;
                    if (o.finish == engine::FinishReason::kError) {
                        bytes = "data: " + DumpJson({{"error", {{"message", o.error.message()}}}}) +
                                "\n\n";
                    } else if (!o.tokens.empty() || final) {
                        bytes = "data: " + DumpJson(item_json(it, i, secs)) + "\n\n";
                    }
                    if (st->done == st->items.size()) {
                        bytes += "data: [DONE]\n\n";
                        st->answered = true;
                    }
                    ex->Write(std::move(bytes));
                    if (st->answered) ex->End();
                    return;
                }
                if (st->done != st->items.size()) return;
                st->answered = true;
                for (const GenItem& e : st->items) {
                    if (e.finish == engine::FinishReason::kError) {
                        return ex->Reply(
                            Error(HttpStatusOf(e.error), {e.error.message(), "", ""}, base));
                    }
                }
                Json out = Json::array();
                for (size_t k = 0; k < st->items.size(); ++k) {
                    out.push_back(item_json(st->items[k], k, secs));
                }
                ex->Reply({200,
                           "application/json",
                           DumpJson(batch ? out : out[0]),
                           {{"X-Request-Id", base}}});
            };
            Status s = engine->Submit(std::move(er));
            if (!s.ok()) {
                for (size_t k = 0; k < i; ++k) engine->Abort(st->items[k].id);
                std::lock_guard lock(st->mu);
                st->answered = true;
                int status = HttpStatusOf(s);
                if (status == 500) status = 400;
                if (stream) {
                    ex->Write("data: " + DumpJson({{"error", {{"message", s.message()}}}}) +
                              "\n\ndata: [DONE]\n\n");
                    return ex->End();
                }
                return ex->Reply(Error(status, {s.message(), "text", ""}, base));
            }
        }
        // A client that goes away has its prompts aborted and their blocks freed.
        ex->OnClose([engine = engine, st] {
            std::vector<std::string> open;
            {
                std::lock_guard lock(st->mu);
                for (const GenItem& it : st->items) {
                    if (it.finish == engine::FinishReason::kNone) open.push_back(it.id);
                }
            }
            for (const std::string& id : open) engine->Abort(id);
        });
    };
    if (g->sglang_fields.is_null()) return run();
    Result<std::optional<std::vector<schema::SglangBootstrap>>> b =
        schema::ParseSglangBootstrap(g->sglang_fields, g->batch ? n : 0);
    if (!b.ok())
        return ex->Reply(Error(400, {b.status().message(), "bootstrap_room", ""}, rid_header));
    if (!*b) return run();
    // Each prompt's room: its push params (a decode worker asks the bootstrap server once per
    // server); then all of them run.
    auto left = std::make_shared<std::atomic<size_t>>(n);
    for (size_t i = 0; i < n; ++i) {
        sglang->Apply(ex, std::move(g->items[i]), (**b)[i], [g, i, left, run](ParsedRequest p) {
            g->items[i] = std::move(p);
            if (left->fetch_sub(1) == 1) run();
        });
    }
}

void OpenAiServer::Impl::AddSglangRoutes(std::vector<http::Route>* r) {
    // A one-token generation here, answered when it finishes (SGLang's checks that the model
    // runs). A prefill or decode worker runs it as a plain request, with no peer.
    auto health_generate = [this](std::shared_ptr<http::Exchange> ex) {
        if (draining.load()) return ex->Reply({503, "text/plain", "draining", {}});
        engine::Request er;
        er.id = "health-generate-" + RandomId128();
        const tokenizer::Tokenizer& tk = engine->model().tokenizer();
        er.prompt = {tk.bos_id() >= 0 ? tk.bos_id() : 0};
        er.sampling.temperature = 0;
        er.sampling.max_tokens = 1;
        std::weak_ptr<http::Exchange> weak = ex;
        er.on_output = [weak](const engine::RequestOutput& o) {
            if (o.finish == engine::FinishReason::kNone) return;
            if (auto ex = weak.lock()) {
                if (o.finish == engine::FinishReason::kError) {
                    return ex->Reply({503, "text/plain", o.error.message(), {}});
                }
                ex->Reply({200, "text/plain", "", {}});
            }
        };
        Status s = engine->Submit(std::move(er));
        if (!s.ok()) ex->Reply({503, "text/plain", s.message(), {}});
    };
    r->push_back({"GET", "/health_generate", health_generate});
    r->push_back({"POST", "/health_generate", health_generate, 4096});
    r->push_back({"GET", "/get_model_info", [this](std::shared_ptr<http::Exchange> ex) {
                      Json j = {{"model_path", model_name},
                                {"tokenizer_path", model_name},
                                {"is_generation", true},
                                {"preferred_sampling_params", nullptr},
                                {"weight_version", "default"},
                                {"has_image_understanding", config.vision != nullptr},
                                {"has_audio_understanding", false},
                                {"model_type", "ferry"}};
                      ex->Reply({200, "application/json", DumpJson(j), {}});
                  }});
    r->push_back({"GET", "/get_server_info", [this](std::shared_ptr<http::Exchange> ex) {
                      const engine::EngineStats s = engine->Stats();
                      double tps = 0;
                      {
                          std::lock_guard lock(metrics.mu);
                          tps = metrics.TokensPerSecond(UnixSeconds());
                      }
                      const int bt = engine->config().block_tokens;
                      Json j = {
                          {"model_path", model_name},
                          {"served_model_name", model_name},
                          {"tp_size", engine->model().tp()},
                          {"dp_size", 1},
                          {"pp_size", 1},
                          {"page_size", bt},
                          {"context_length", engine->max_model_len()},
                          {"max_total_num_tokens", int64_t(s.kv_blocks_total) * bt},
                          {"disaggregation_mode", config.pd_role.empty() ? "null" : config.pd_role},
                          {"disaggregation_bootstrap_port", sglang && sglang->bootstrap_port()
                                                                ? Json(sglang->bootstrap_port())
                                                                : Json(nullptr)},
                          {"version", "ferry"},
                          {"internal_states", Json::array({{{"last_gen_throughput", tps},
                                                            {"avg_spec_accept_length", nullptr},
                                                            {"num_running_reqs", s.running},
                                                            {"num_waiting_reqs", s.waiting}}})}};
                      ex->Reply({200, "application/json", DumpJson(j), {}});
                  }});
    // Forgets the prefix cache (SGLang's radix cache) when nothing is in flight. It changes
    // what every later request costs: an internal route (loopback without a secret, the router
    // token with one), as /add_remote_prefill_eps.
    auto flush = [this](std::shared_ptr<http::Exchange> ex) {
        std::string who;
        if (auto refused = Authenticate(ex->request(), true, &who)) return ex->Reply(*refused);
        const bool ok = engine->FlushPrefixCache(std::chrono::seconds(5));
        ex->Reply({ok ? 200 : 400,
                   "text/plain",
                   "Cache flushed.\nPlease check backend logs for more details. (When there are "
                   "running or waiting requests, the operation will not be performed.)\n",
                   {}});
    };
    r->push_back({"POST", "/flush_cache", flush, 4096});
    r->push_back({"GET", "/flush_cache", flush});
}

}  // namespace ferry::serve
