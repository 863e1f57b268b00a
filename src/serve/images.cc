// Images in chat requests: each image_url part read (data: or file:// URL) and decoded off the
// I/O threads, its embeddings found in the encoder cache by mm_hash or computed by the vision
// encoder, placed at its placeholder tokens (engine::MmInput). A bad image is a 400 naming its
// part; memory stays bounded: one image is decoded at a time, and the queue of requests
// waiting for it is capped (503 beyond).
#include "serve/openai_server_parts.h"

namespace ferry::serve {

namespace {

uint64_t MicrosSince(Clock::time_point t0) {
    return uint64_t(
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count());
}

}  // namespace

Status OpenAiServer::Impl::EncodeImages(ParsedRequest* pr, BadRequest* bad) {
    for (model::ImagePart& part : pr->images) {
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
        if (!e) {
            const Clock::time_point t1 = Clock::now();
            e = std::make_shared<const std::vector<float>>(
                config.vision->Encode(image->rgb.data(), image->width, image->height));
            image_metrics.encode_micros += MicrosSince(t1);
            ++image_metrics.encoded;
            encoder_cache->Insert(hash, e);
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
    auto job = [this, ex, chat, rid, pr = std::move(pr)]() mutable {
        if (stopping) {
            return ex->Reply(Error(503, {"the server is stopping", "", ""}, rid));
        }
        BadRequest bad;
        if (!EncodeImages(&pr, &bad).ok()) {
            ++image_metrics.refused;
            return ex->Reply(Error(400, bad, rid));
        }
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

}  // namespace ferry::serve
